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
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from moe_rl.config.eval_section import eval_and_filters
from moe_rl.config.loader import ConfigError
from moe_rl.config.loss_keys import ignored_loss_keys
from moe_rl.config.memory_plan import memory_fits
from moe_rl.config.preflight_data import data_files, hf_model_directory, reward_settings
from moe_rl.config.schema import ExperimentConfig
from moe_rl.exact.preflight import true_on_policy_settings

__all__ = [
    "PreflightError", "PreflightReport", "config_problems", "environment_problems", "preflight",
    "run_preflight", "ksm_is_noop", "ksm_active",
]  # fmt: skip


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


def ksm_is_noop(cfg: ExperimentConfig) -> bool:
    """Keep Sampling Mask on untruncated sampling (top_p = 1, top_k <= 0): the kept set is the vocab."""
    r = cfg.rollout
    return cfg.replay.keep_sampling_mask and r.top_p >= 1.0 and r.top_k <= 0


def ksm_active(cfg: ExperimentConfig) -> bool:
    """Keep Sampling Mask requests masks and renormalises: on, and sampling truncates (else a no-op)."""
    return cfg.replay.keep_sampling_mask and not ksm_is_noop(cfg)


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


def sampling_settings(cfg: ExperimentConfig) -> Iterable[str]:
    r = cfg.rollout
    if r.top_k == 0:
        yield "rollout.top_k=0 samples from no token; expected -1 (no top-k) or >= 1"
    if cfg.replay.keep_sampling_mask and r.top_k > r.sampling_mask_max_tokens:
        yield (
            f"rollout.top_k={r.top_k} exceeds rollout.sampling_mask_max_tokens={r.sampling_mask_max_tokens} "
            "(the largest kept set SGLang returns for replay.keep_sampling_mask); lower top_k or raise the cap"
        )


def task_and_lengths(cfg: ExperimentConfig) -> Iterable[str]:
    """The task exists, its vocabulary fits the model, and prompt + response fit model.seq_length."""
    from moe_rl.tasks.synthetic import KNOWN_TASKS, DigitTask

    t, m, r = cfg.train, cfg.model, cfg.rollout
    if cfg.data is not None:  # prompts come from data.train_files (moe_rl.config.preflight_data)
        return
    if t.task not in KNOWN_TASKS:
        yield f"train.task={t.task!r} is not a known task; expected one of {sorted(KNOWN_TASKS)}"
        return
    try:
        task = DigitTask(t.task, m.vocab_size)
    except ValueError as exc:  # the task vocabulary does not fit model.vocab_size
        yield str(exc)
        return
    prompt_len = len(task.make_prompt([1] * task.digit_range[1]).ids)  # the longest prompt
    if prompt_len + r.max_new_tokens > m.seq_length:
        room = m.seq_length - prompt_len
        fix = f"rollout.max_new_tokens <= {room} or " if room >= 1 else ""
        yield (
            f"rollout.max_new_tokens={r.max_new_tokens} plus the {prompt_len}-token prompt of train.task={t.task!r} "
            f"exceeds model.seq_length={m.seq_length}; expected {fix}model.seq_length >= {prompt_len + r.max_new_tokens}"
        )


def reward_fn_imports(cfg: ExperimentConfig) -> Iterable[str]:
    if cfg.train.reward_fn is None:
        return
    from moe_rl.tasks.synthetic import load_reward_fn

    try:
        load_reward_fn(cfg.train.reward_fn)
    except ValueError as exc:
        yield str(exc)
    except Exception as exc:  # noqa: BLE001 -- a user module failing at import time: report, do not crash
        yield f"train.reward_fn={cfg.train.reward_fn!r} raised {type(exc).__name__} on import: {exc}"


def learner_features(cfg: ExperimentConfig) -> Iterable[str]:
    """What the learner build and the training loop refuse (moe_rl.learner.model, trainer)."""
    m, p = cfg.model, cfg.parallel
    if m.mtp_num_layers:
        yield (
            f"model.mtp_num_layers={m.mtp_num_layers}: multi-token prediction layers are neither built by the "
            "learner nor exported to SGLang; expected 0"
        )
    if ksm_active(cfg) and p.tp > 1 and cfg.loss.entropy_coef:
        yield (
            f"replay.keep_sampling_mask=true with parallel.tp={p.tp} and loss.entropy_coef={cfg.loss.entropy_coef}: "
            "the kept-set entropy is not computed on vocab-sharded logits yet (the kept-set log-prob is); "
            "expected loss.entropy_coef=0 or parallel.tp=1"
        )
    yield from pipeline_stages(cfg)
    if p.cp > 1:
        yield f"parallel.cp={p.cp}: the training loop does not split sequences over context parallelism; expected 1"
    etp = p.tp if p.etp is None else p.etp
    for key, value, split in (("model.vocab_size", m.vocab_size, p.tp), ("model.ffn_hidden_size", m.ffn_hidden_size, p.tp),
                              ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size, etp)):  # fmt: skip
        if value % split:
            yield f"{key}={value} must be divisible by the {split} tensor-parallel shards it is split into (parallel.tp/etp)"


def optimizer_options(cfg: ExperimentConfig) -> Iterable[str]:
    """Megatron-Core's distributed-optimizer options that need each other (optimizer_config.py asserts, or
    the option has no effect): offload and precision-aware state live in the distributed optimizer."""
    o = cfg.optim
    for key, on in (("optim.optimizer_cpu_offload", o.optimizer_cpu_offload),
                    ("optim.use_precision_aware_optimizer", o.use_precision_aware_optimizer)):  # fmt: skip
        if on and not o.use_distributed_optimizer:
            yield (f"{key}=true needs optim.use_distributed_optimizer=true (Megatron-Core keeps offloaded and "
                   "lower-precision optimizer state only in its distributed optimizer)")  # fmt: skip
    if o.optimizer_offload_fraction != 1.0 and not o.optimizer_cpu_offload:
        yield (f"optim.optimizer_offload_fraction={o.optimizer_offload_fraction} has no effect without "
               "optim.optimizer_cpu_offload=true; expected 1.0 or offload on")  # fmt: skip


def pipeline_stages(cfg: ExperimentConfig) -> Iterable[str]:
    """pp > 1 (equal stages: the schema checks ``num_layers % pp``): every stage holds at least one MoE layer
    (routing replay and the dispatch probe bind per stage), and the dispatcher accepts ragged microbatches."""
    m, pp = cfg.model, cfg.parallel.pp
    if pp == 1:
        return
    if m.num_layers % pp:  # the schema refuses it ("parallel.pp=... must divide model.num_layers=...")
        return
    if m.moe_token_dispatcher_type == "allgather":
        yield (f"model.moe_token_dispatcher_type='allgather' with parallel.pp={pp}: Megatron-Core refuses the "
               "allgather dispatcher with variable_seq_lengths, which pipeline stages need for ragged microbatches; "
               "expected 'alltoall'")  # fmt: skip
    per_stage = m.num_layers // pp
    pattern = m.moe_layer_pattern()
    dense = [s for s in range(pp) if not any(pattern[s * per_stage : (s + 1) * per_stage])]
    if dense:
        yield (f"parallel.pp={pp}: pipeline stage(s) {dense} would hold only dense layers "
               f"(model.first_k_dense_layers={m.first_k_dense_layers}, model.moe_layer_freq={m.moe_layer_freq}, "
               f"{per_stage} decoder layer(s) per stage); expected every stage to hold a MoE layer: "
               "lower parallel.pp")  # fmt: skip


def weight_sync_architecture(cfg: ExperimentConfig) -> Iterable[str]:
    """HF export (weight sync to SGLang, init_from_hf) covers the Qwen3-MoE family."""
    from moe_rl.learner.hf_arch import unsupported_for_hf

    for reason in unsupported_for_hf(cfg.model):
        yield f"{reason}: the HF <-> Megatron bridge (weight sync to SGLang) cannot express it"


def rollout_mode(cfg: ExperimentConfig) -> Iterable[str]:
    """Asynchronous rollouts need a producer: servers to generate from (docs/training.md, 'sync -> async')."""
    if cfg.train.rollout_mode == "async" and cfg.train.rollouts_from:
        yield ("train.rollout_mode=async overlaps generation with training; train.rollouts_from trains on saved "
               "records without servers (set train.rollout_mode=sync)")  # fmt: skip


def partial_rollouts(cfg: ExperimentConfig) -> Iterable[str]:
    """A weight update interrupts in-flight requests only where rollouts overlap training."""
    mode = cfg.train.rollout_mode
    if cfg.rollout.partial and mode != "async":
        yield (
            f"rollout.partial=true pauses in-flight requests at a weight update, which only the asynchronous "
            f"producer has in flight; train.rollout_mode={mode!r}: expected rollout.partial=false or "
            "train.rollout_mode=async"
        )


def partial_rollout_notes(cfg: ExperimentConfig) -> Iterable[str]:
    if cfg.rollout.partial and cfg.rollout.pause_mode == "in_place":
        yield (
            "rollout.pause_mode=in_place is approximate: tokens sampled after a weight update attend to prefix KV the "
            "old weights computed, so they match no single weight version; they are recorded at the new version "
            "and counted as async/kv_stale_tokens (retract or abort re-prefill and are exact; docs/sglang.md)"
            + ("; with rollout.deterministic=false the radix cache is on and not flushed at the update, so later "
               "requests may reuse old-weight prefix KV that is not counted" if not cfg.rollout.deterministic else "")
        )


def weight_sync_group(cfg: ExperimentConfig) -> Iterable[str]:
    """``rollout.weight_sync: distributed``: NCCL moves CUDA tensors only (a CPU server cannot join), and
    SGLang's group update serves one data-parallel replica whose ranks are its tp ranks."""
    r = cfg.rollout
    if r.weight_sync != "distributed":
        return
    if r.weight_sync_backend == "nccl" and r.device != "cuda":
        yield (f"rollout.weight_sync_backend='nccl' with rollout.device={r.device!r}: a CPU SGLang server receives "
               "weights over gloo only; expected rollout.weight_sync_backend='gloo' (or 'auto')")  # fmt: skip
    for option, value in _server_options(r.extra_server_args, _GROUP_UNSUPPORTED):
        yield (f"rollout.extra_server_args {option}{'' if value is None else ' ' + value} with "
               "rollout.weight_sync='distributed': SGLang 0.5.23's weight-update group asserts one data-parallel "
               "replica and ranks the server's processes by tp rank only (pipeline stages would collide); "
               "expected that option left out (or at 1), or rollout.weight_sync='disk'")  # fmt: skip


# SGLang server options the distributed weight update cannot serve: name -> (takes a value, refused unless == "1")
_GROUP_UNSUPPORTED = {
    "--dp-size": True, "--data-parallel-size": True, "--attn-dp-size": True, "--attention-data-parallel-size": True,
    "--pp-size": True, "--pipeline-parallel-size": True, "--enable-dp-attention": False,
}  # fmt: skip


def _server_options(args: list[str], table: dict[str, bool]) -> Iterable[tuple[str, str | None]]:
    """``(option, value)`` of each option of ``table`` set in ``args`` to something other than 1."""
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name not in table:
            continue
        if not table[name]:
            yield name, None
            continue
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
        if value.strip() != "1":
            yield name, value


CONFIG_RULES: tuple[ConfigRule, ...] = (
    finite_numbers, hf_model_directory, sampling_settings, task_and_lengths, reward_fn_imports, learner_features,
    optimizer_options, weight_sync_architecture, weight_sync_group, ignored_loss_keys, data_files, reward_settings,
    eval_and_filters, rollout_mode, partial_rollouts, memory_fits, true_on_policy_settings,
)  # fmt: skip


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
    if ksm_is_noop(cfg):
        report.notes.append(
            "replay.keep_sampling_mask=true with rollout.top_p=1 and rollout.top_k=-1: sampling is untruncated, "
            "so no masks are requested and Keep Sampling Mask is a no-op"
        )
    return report


# --- environment rules --------------------------------------------------------------------------


def _world_size(environ: Mapping[str, str]) -> int:
    try:
        return int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return -1


def process_count(cfg: ExperimentConfig, environ: Mapping[str, str]) -> Iterable[str]:
    p = cfg.parallel
    world = _world_size(environ)
    if world < 1:
        yield f"WORLD_SIZE={environ.get('WORLD_SIZE')!r} is not a positive integer"
        return
    etp = p.tp if p.etp is None else p.etp
    dense, expert = p.tp * p.pp * p.cp, etp * p.ep * p.pp
    if world % dense or world % expert:
        yield (
            f"parallel.tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep} etp={etp} need a process count divisible by "
            f"tp*pp*cp={dense} and etp*ep*pp={expert}; this run has WORLD_SIZE={world} "
            f"(start it with torchrun --nproc-per-node {math.lcm(dense, expert)}, or lower the sizes)"
        )
        return
    dp = world // dense
    per_minibatch = cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt // cfg.train.minibatches_per_step
    if per_minibatch % dp:
        yield (
            f"each minibatch has {per_minibatch} samples (train.prompts_per_step x rollout.samples_per_prompt / "
            f"train.minibatches_per_step), which the {dp} data-parallel ranks of WORLD_SIZE={world} cannot share "
            f"equally; make it a multiple of {dp}"
        )


def accelerator(cfg: ExperimentConfig, environ: Mapping[str, str]) -> Iterable[str]:
    import torch

    from moe_rl.learner.fp8 import fp8_runtime_missing
    from moe_rl.learner.model import use_transformer_engine

    if cfg.parallel.tp > 1 and not use_transformer_engine():
        yield (
            f"parallel.tp={cfg.parallel.tp} needs Transformer Engine on a GPU (Megatron-Core trains MoE with tp > 1 "
            "only under sequence parallelism); expected parallel.tp=1 on this machine"
        )
    if cfg.precision.fp8 is not None:
        missing = fp8_runtime_missing()
        if missing:
            yield f"precision.fp8 needs {' and '.join(missing)}; expected precision.fp8=null on this machine"
    if not cfg.rollout.addresses and cfg.rollout.device == "cuda" and not torch.cuda.is_available():
        yield "rollout.device='cuda' launches SGLang on a GPU, and this machine has none; expected rollout.device='cpu'"


def rollout_addresses(cfg: ExperimentConfig, environ: Mapping[str, str]) -> Iterable[str]:
    import httpx

    for url in cfg.rollout.addresses:
        try:
            httpx.get(f"{url.rstrip('/')}/health", timeout=5.0).raise_for_status()
        except (httpx.HTTPError, ValueError) as exc:
            yield f"rollout.addresses: {url}/health is not reachable ({type(exc).__name__}: {exc})"


def weight_sync_rendezvous(cfg: ExperimentConfig, environ: Mapping[str, str]) -> Iterable[str]:
    """``rollout.weight_sync: distributed``: rank 0 can listen on the rendezvous port; NCCL has a GPU here."""
    import torch

    from moe_rl.rollout.weight_group import group_options, port_is_free

    r = cfg.rollout
    if r.weight_sync != "distributed":
        return
    port = r.weight_sync_master_port
    if port is not None and environ.get("RANK", "0") == "0" and not port_is_free(port):
        yield (f"rollout.weight_sync_master_port={port} is in use on this host; rank 0 listens there for the "
               "weight-update group's rendezvous: expected a free port (or null: pick one)")  # fmt: skip
    if group_options(r)["backend"] == "nccl" and not torch.cuda.is_available():
        yield ("rollout.weight_sync='distributed' over nccl broadcasts from the learner's GPU, and this machine has "
               "none; expected rollout.weight_sync_backend='gloo' with CPU servers, or another rollout.weight_sync")  # fmt: skip


ENV_RULES = (process_count, accelerator, rollout_addresses, weight_sync_rendezvous)


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
