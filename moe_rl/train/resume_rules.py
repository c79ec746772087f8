"""The resume rules of a run directory that already holds a run, and ``RunDirError``, which every guard raises.

Owns the decision to start fresh, refuse, discard or resume (never the locks, the writability check or the
multi-rank broadcast: ``moe_rl.train.run_dir``, which applies these rules on rank 0). The rules:

- a directory where an earlier start trained no step (its ``run_id``, no checkpoint, no metrics line of a
  step >= 1: e.g. a start refused at its first step) holds no run: what that start wrote is removed and
  the run starts fresh;
- ``checkpoint.resume=never`` refuses unless ``checkpoint.overwrite=true`` (which discards the old
  checkpoints, their reference policy and identity, metrics and config);
- ``checkpoint.resume=auto`` first checks that the checkpoints in ``checkpoint.dir`` belong to this
  output directory's run (``<checkpoint.dir>/run.json`` names the run id and output directory that
  wrote them; checkpoints with no such record are resumed only next to the ``config.yaml`` of their run),
  then compares the saved ``config.yaml`` with the new config key by key; keys on
  ``RESUME_SAFE_KEYS`` (operational: addresses, ports, timeouts, logging, the key variables,
  ``train.steps``, and the ``parallel.*`` layout, which the checkpoint loader reshards) and keys named
  in ``checkpoint.allow_changes`` may differ (each change is logged), any other difference
  (including a key the old run did not have, unless the new value is that key's default: a run saved before
  the key existed behaved as its default) refuses the start and prints every difference.
  ``train.steps`` is safe only while the lr schedule does not depend on it
  (``optim.lr_decay_style=constant``): a decaying schedule spans ``train.steps``, so a resumed run with
  another value would get another lr than an uninterrupted one.
"""

from __future__ import annotations

import fnmatch
import logging
import shutil
from pathlib import Path

import yaml
from pydantic import ValidationError

from moe_rl.config import ExperimentConfig
from moe_rl.learner.checkpoint import checkpoint_steps
from moe_rl.learner.reference import REFERENCE_DIR
from moe_rl.train.metrics_log import step_of
from moe_rl.train.run_identity import CKPT_IDENTITY_FILE, RUN_ID_FILE, read_checkpoint_identity, read_run_id

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
# Keys that may change when a run resumes: where the servers are and how long to wait for them, how
# metrics are logged, which variables hold the keys, how many steps to run, these rules themselves, and
# the parallel layout and whether the optimizer state is sharded (checkpoints are layout-free:
# moe_rl.learner.checkpoint reshards them on load, into or out of the distributed optimizer).
RESUME_SAFE_KEYS = (
    "rollout.addresses",
    "rollout.host",
    "rollout.port",
    "launch.rollout_port",
    "launch.master_port",
    "rollout.request_timeout_s",
    "rollout.startup_timeout_s",
    "rollout.max_concurrency",  # requests in flight (unset: derived per server; runs before it saved 16)
    "rollout.server_concurrency",
    "launch.signal_lead_s",  # when the warning comes (unset: derived from the plan; runs before it saved 300)
    "rollout.health_timeout_s",
    "rollout.max_server_restarts",
    "rollout.max_process_restarts",
    "rollout.api_key_env",
    "rollout.admin_api_key_env",
    "logging.*",
    "train.steps",
    "checkpoint.allow_changes",
    "checkpoint.overwrite",
    "parallel.*",
    "model.build_command",
    "optim.use_distributed_optimizer",
    "rollout.max_foreign_syncs",
    "correction.kl_alarm",
    "correction.kl_alarm_max_in_row",
    "correction.kl_alarm_factor",
    "correction.kl_alarm_window",
    "correction.kl_alarm_warmup",
)


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked; the message says why and which key changes that."""


# ------------------------------------------------------------------------------------ resume rules
def _flatten(tree, prefix: str = "") -> dict[str, object]:
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    out: dict[str, object] = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


_ABSENT = "<absent>"


def _with_defaults(saved_tree: dict) -> dict[str, object]:
    """The saved config as today's schema reads it (keys added since it was saved at their defaults);
    empty when it no longer validates (then every difference counts)."""

    try:
        return _flatten(ExperimentConfig.model_validate(saved_tree).model_dump(mode="json"))
    except (ValidationError, ValueError, TypeError):
        return {}


def config_differences(saved_tree: dict, cfg) -> list[tuple[str, object, object]]:
    """``(key, saved, new)`` for every dotted key whose value differs (``<absent>`` for a missing key); a key
    the saved config lacks (added to the schema since) whose new value is its default is no difference."""
    old, new = _flatten(saved_tree), _flatten(cfg.model_dump(mode="json"))
    diffs = [
        (k, old.get(k, _ABSENT), new.get(k, _ABSENT))
        for k in sorted(old.keys() | new.keys())
        if old.get(k, _ABSENT) != new.get(k, _ABSENT)
    ]
    if any(k not in old for k, _, _ in diffs):
        defaults = _with_defaults(saved_tree)
        diffs = [d for d in diffs if d[0] in old or d[0] not in defaults or defaults[d[0]] != d[2]]
    return diffs


def is_allowed_change(key: str, allowed: tuple[str, ...] | list[str]) -> bool:
    return any(key == pattern or fnmatch.fnmatchcase(key, pattern) for pattern in allowed)


def previous_run(run_dir: Path, ckpt_dir: Path) -> list[str]:
    """What in ``run_dir`` shows an earlier run (empty list: a fresh directory)."""

    found = []
    if (run_dir / CONFIG_FILE).is_file():
        found.append(CONFIG_FILE)
    metrics = run_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size:
        found.append(f"{METRICS_FILE} ({sum(1 for _ in metrics.open())} lines)")
    if steps := checkpoint_steps(ckpt_dir):
        found.append(f"checkpoints at steps {steps} in {ckpt_dir}")
    return found


def schedule_bound_steps(key: str, cfg) -> bool:
    """True when ``key`` is ``train.steps`` and the lr schedule spans it (a decaying ``optim.lr_decay_style``)."""
    return key == "train.steps" and cfg.optim.lr_decay_style != "constant"


STEPS_REASON = (
    "train.steps sets the length of the lr schedule (optim.lr_decay_style={style} decays to optim.min_lr at "
    "train.steps x train.minibatches_per_step x train.epochs_per_step optimizer steps): resumed with another value, "
    "the remaining steps get another lr than an uninterrupted run would"
)


def check_checkpoint_owner(run_dir: Path, ckpt_dir: Path) -> None:
    """Refuse checkpoints in ``ckpt_dir`` that another run (or no known run) wrote (module docstring)."""

    if not checkpoint_steps(ckpt_dir):
        return
    owner, ours = read_checkpoint_identity(ckpt_dir), read_run_id(run_dir)
    if owner is None:
        if (run_dir / CONFIG_FILE).is_file():
            return  # written before run identities existed, next to its own run's config: compared below
        raise RunDirError(
            f"checkpoint.dir={ckpt_dir} holds checkpoints that no run in train.output_dir={run_dir} wrote (no "
            f"{CKPT_IDENTITY_FILE} in checkpoint.dir, no {CONFIG_FILE} in train.output_dir): resuming them would "
            "continue an unknown run's weights, optimizer and step. Point train.output_dir at the run that wrote "
            "them, pass checkpoint.resume=never checkpoint.overwrite=true to discard them, or set another "
            "checkpoint.dir"
        )
    if owner["run_id"] != ours:
        this = f"run {ours!r}" if ours else "a new run"
        raise RunDirError(
            f"checkpoint.dir={ckpt_dir} holds the checkpoints of run {owner['run_id']!r} (train.output_dir="
            f"{owner.get('output_dir')}), but train.output_dir={run_dir} is {this}: two runs cannot share a "
            "checkpoint.dir. Resume that run with its own train.output_dir, pass checkpoint.resume=never "
            "checkpoint.overwrite=true to discard its checkpoints, or set another checkpoint.dir"
        )


def trained_no_step(run_dir: Path, ckpt_dir: Path) -> bool:
    """True when ``run_dir`` holds only what a trainer's start that trained no step leaves: its ``run_id``
    (so a ``config.yaml`` someone put there is never taken for one), no checkpoint and no metrics line of
    a step >= 1 (an evaluation before the first step logs step 0)."""

    if read_run_id(run_dir) is None or checkpoint_steps(ckpt_dir):
        return False
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        return True
    with metrics.open(errors="replace") as fh:
        return not any((step_of(line) or 0) >= 1 for line in fh)


def forget_failed_start(run_dir: Path, ckpt_dir: Path) -> None:
    """Remove what a start that trained no step wrote (config, run id, metrics, its checkpoint.dir identity),
    so the corrected command starts fresh instead of being compared with the refused settings (logged)."""
    ours = read_run_id(run_dir)
    owner = read_checkpoint_identity(ckpt_dir)
    if owner is not None and owner["run_id"] == ours:
        (ckpt_dir / CKPT_IDENTITY_FILE).unlink(missing_ok=True)
    for name in (CONFIG_FILE, METRICS_FILE, RUN_ID_FILE):
        (run_dir / name).unlink(missing_ok=True)
    logger.warning(
        "train.output_dir=%s holds only what an earlier start that trained no step left (no checkpoint, "
        "no step's metrics): starting fresh",
        run_dir,
    )


def check_resume(cfg, run_dir: Path, ckpt_dir: Path) -> None:
    """Apply the resume rules (module docstring); discards the old run when ``checkpoint.overwrite``."""
    found = previous_run(run_dir, ckpt_dir)
    if not found:
        return
    if trained_no_step(run_dir, ckpt_dir):  # e.g. refused before step 1: nothing to resume or to protect
        forget_failed_start(run_dir, ckpt_dir)
        return
    ck = cfg.checkpoint
    if ck.resume == "never":
        if not ck.overwrite:
            raise RunDirError(
                f"train.output_dir={run_dir} holds a previous run ({', '.join(found)}) and checkpoint.resume=never "
                "would overwrite it. Pass checkpoint.overwrite=true to discard it, checkpoint.resume=auto to "
                "continue it, or set another train.output_dir"
            )
        discard_previous_run(run_dir, ckpt_dir)
        return
    check_checkpoint_owner(run_dir, ckpt_dir)
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.is_file():
        return
    try:
        saved = yaml.safe_load(saved_path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise RunDirError(f"cannot read the previous run's {saved_path} to compare settings: {exc}") from None
    diffs = config_differences(saved, cfg)
    allowed = (*RESUME_SAFE_KEYS, *ck.allow_changes)
    unsafe = [
        d
        for d in diffs
        if not is_allowed_change(d[0], allowed)
        or (schedule_bound_steps(d[0], cfg) and not is_allowed_change(d[0], ck.allow_changes))
    ]
    lines = [f"  {'!' if d in unsafe else ' '} {k}: {old!r} -> {new!r}" for d in diffs for k, old, new in [d]]
    if unsafe:
        keys = ",".join(k for k, _, _ in unsafe)
        reasons = [
            STEPS_REASON.format(style=cfg.optim.lr_decay_style) for k, _, _ in unsafe if schedule_bound_steps(k, cfg)
        ]
        raise RunDirError(
            f"resuming {run_dir} with changed settings ({len(unsafe)} not safe to change, marked !):\n"
            + "\n".join(lines + [f"  ({r})" for r in reasons])
            + f"\nTo continue anyway pass checkpoint.allow_changes=[{keys}]; to start over pass "
            "checkpoint.resume=never checkpoint.overwrite=true; or use another train.output_dir"
        )
    if diffs:
        reshard = any(k.startswith("parallel.") for k, _, _ in diffs)
        logger.warning(
            "resuming %s with changed operational settings%s:\n%s",
            run_dir,
            " (parallel layout changed: the checkpoint is resharded to the new layout)" if reshard else "",
            "\n".join(lines),
        )


def discard_previous_run(run_dir: Path, ckpt_dir: Path) -> None:
    """checkpoint.overwrite: remove the old checkpoints, their reference policy and identity, metrics and
    config (logged)."""

    for step in checkpoint_steps(ckpt_dir):
        shutil.rmtree(ckpt_dir / f"step_{step:08d}")
    shutil.rmtree(ckpt_dir / REFERENCE_DIR, ignore_errors=True)
    for path in (
        ckpt_dir / "latest",
        ckpt_dir / CKPT_IDENTITY_FILE,
        run_dir / METRICS_FILE,
        run_dir / CONFIG_FILE,
        run_dir / RUN_ID_FILE,
    ):
        path.unlink(missing_ok=True)
    logger.warning("checkpoint.overwrite=true: discarded the previous run in %s", run_dir)
