"""Preflight: every reason a validated config would still fail later, reported at once, up front.

Owns two kinds of rules (docs/configs.md lists each with its message):

* config rules (``config_problems``) -- what the config alone decides: the trainer, learner
  build, rollout client and HF exporter would refuse it. ``moe-rl config validate`` runs them
  everywhere, and every file in ``configs/`` must pass them.
* environment rules (``environment_problems``) -- what depends on the machine and the process:
  GPU, Transformer Engine, the process count vs the parallel sizes, reachable rollout servers.
  They run at the start of ``train``/``ablate``/``diagnose`` and in ``config validate --env``.

A rule is a function ``(cfg[, env]) -> Iterable[str]``; each message names the dotted key, its
value and what would work. ``notes`` are things a user should know that do not stop a run.
The schema (``moe_rl.config.schema``) already guarantees per-field types and ranges.

This module is the entry point (``preflight``, ``run_preflight``, ``config_problems``,
``environment_problems``) and holds the rule lists; the rules live by subsystem: ``tasks``,
``learner``, ``rollout``, ``sync``, ``data`` (model directory, datasets, reward) here, and the
config-only rules in ``moe_rl.config`` (``loss_keys``, ``advantage_keys``, ``eval_section``), ``moe_rl.sizing`` and
``moe_rl.exact.preflight``. It sits beside ``cli``: it imports the subsystems, ``moe_rl.config``
imports none of them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from moe_rl.config import ConfigError, ExperimentConfig
from moe_rl.config.advantage_keys import advantage_settings
from moe_rl.config.correction_keys import correction_settings
from moe_rl.config.eval_section import eval_and_filters
from moe_rl.config.loss_keys import ignored_loss_keys
from moe_rl.exact.preflight import true_on_policy_settings
from moe_rl.preflight.data import data_files, hf_model_directory, reward_settings
from moe_rl.preflight.learner import accelerator, learner_features, optimizer_options, process_count
from moe_rl.preflight.rollout import (
    agent_loop,
    external_server_key_notes,
    partial_rollout_notes,
    partial_rollouts,
    rollout_addresses,
    rollout_mode,
    sampling_settings,
    server_keys,
)
from moe_rl.preflight.sync import weight_sync_architecture, weight_sync_group, weight_sync_rendezvous
from moe_rl.preflight.tasks import reward_fn_imports, task_and_lengths
from moe_rl.sizing import job_fits

__all__ = [
    "PreflightError",
    "PreflightReport",
    "config_problems",
    "environment_problems",
    "preflight",
    "run_preflight",
]


class PreflightError(ConfigError):
    """A config (or this machine) cannot run it; the message lists every problem, one per line."""


@dataclass
class PreflightReport:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def raise_if_any(self, what: str) -> None:
        if self.problems:
            raise PreflightError(f"{what} cannot run:\n  " + "\n  ".join(self.problems))


ConfigRule = Callable[[ExperimentConfig], Iterable[str]]


# --- config rules -------------------------------------------------------------------------------


def _walk_numbers(node, prefix: str = ""):
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _walk_numbers(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk_numbers(value, f"{prefix[:-1]}[{i}].")
    elif isinstance(node, float):
        yield prefix[:-1], node


def finite_numbers(cfg: ExperimentConfig) -> Iterable[str]:
    for key, value in _walk_numbers(cfg.model_dump()):
        if not math.isfinite(value):
            yield f"{key}={value} is not a finite number; expected a finite value"


CONFIG_RULES: tuple[ConfigRule, ...] = (
    finite_numbers,
    hf_model_directory,
    sampling_settings,
    task_and_lengths,
    reward_fn_imports,
    learner_features,
    optimizer_options,
    weight_sync_architecture,
    weight_sync_group,
    ignored_loss_keys,
    advantage_settings,
    correction_settings,
    data_files,
    reward_settings,
    eval_and_filters,
    rollout_mode,
    partial_rollouts,
    agent_loop,
    job_fits,
    true_on_policy_settings,
)


def config_problems(cfg: ExperimentConfig) -> PreflightReport:
    """Run every config rule; never raises for a bad config (the report lists it)."""
    report = PreflightReport()
    keys_reported: set[str] = set()
    for rule in CONFIG_RULES:
        for problem in rule(cfg):
            key = problem.split("=", 1)[0].split(":", 1)[0]
            if key not in keys_reported:  # one message per key, from the first rule that refuses it
                report.problems.append(problem)
                keys_reported.add(key)
    report.notes.extend(partial_rollout_notes(cfg))
    report.notes.extend(external_server_key_notes(cfg))
    if cfg.ksm_is_noop:
        report.notes.append(
            "replay.keep_sampling_mask=true with rollout.top_p=1 and rollout.top_k=-1: sampling is untruncated, "
            "so no masks are requested and Keep Sampling Mask is a no-op"
        )
    return report


# --- environment rules --------------------------------------------------------------------------


ENV_RULES = (process_count, accelerator, server_keys, rollout_addresses, weight_sync_rendezvous)


def environment_problems(cfg: ExperimentConfig, environ: Mapping[str, str] | None = None) -> PreflightReport:
    environ = os.environ if environ is None else environ
    report = PreflightReport()
    for rule in ENV_RULES:
        report.problems.extend(rule(cfg, environ))
    return report


def run_preflight(cfg: ExperimentConfig, env: bool, environ: Mapping[str, str] | None = None) -> PreflightReport:
    """Config rules, plus environment rules when ``env``; both lists merged into one report."""
    report = config_problems(cfg)
    if env:
        more = environment_problems(cfg, environ)
        report.problems.extend(more.problems)
        report.notes.extend(more.notes)
    return report


def preflight(cfg: ExperimentConfig, env: bool = True, environ: Mapping[str, str] | None = None) -> list[str]:
    """Raise ``PreflightError`` listing every problem of ``cfg`` (and of this machine when ``env``).

    Returns the notes (things worth logging that do not stop a run).
    """
    report = run_preflight(cfg, env, environ)
    report.raise_if_any(f"config {cfg.name!r}")
    return report.notes
