"""Defaults derived from the job plan where the config leaves them unset (``None``), each with its value and why.

Owns the one place each derived value is computed (a pure function of the config): ``startup_timeout``
(``rollout.startup_timeout_s``: a base plus the bytes each server loads at ``launch.fs_bandwidth_gb_s``),
``request_timeout`` (``rollout.request_timeout_s``: a base plus ``rollout.max_new_tokens`` at a floor decode
rate), ``client_concurrency`` (``rollout.max_concurrency``: ``rollout.server_concurrency`` per server x the
servers), ``signal_lead`` (``launch.signal_lead_s``: the plan's step + save + stop time, from ``step_time``), the
weight-sync mode a launch gets and its per-step disk bytes and time (``disk_sync``), the preflight rule
``signal_lead_fits`` and the lines ``launch --dry-run``, ``moe-rl plan`` and ``config validate`` print
(``derived_lines``). The rollout client, the server launcher and the launch script read these values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from moe_rl.config.memory_plan import GB, launch_world, local_params
from moe_rl.config.schema import ExperimentConfig
from moe_rl.sizing import terms
from moe_rl.sizing.plan import job_plan

__all__ = [
    "Derived",
    "client_concurrency",
    "derived_lines",
    "disk_sync",
    "request_timeout",
    "signal_lead",
    "signal_lead_fits",
    "startup_timeout",
    "step_time",
    "sync_mode",
]

STARTUP_BASE_S = 180  # the fixed default before: imports, CUDA graph capture, a loaded CPU machine's start
REQUEST_BASE_S = 120  # the fixed default before: prefill and queueing of one request
# The slowest decode a request's bound allows (tokens/s of one request on a loaded server): ~3x under
# DECODE_TOKENS_PER_S, the rate the step estimate assumes. Both are assumptions until a GPU run measures them.
MIN_DECODE_TOKENS_PER_S = 10
DECODE_TOKENS_PER_S = 30
# Training FLOP/s one learner GPU sustains (bf16/FP8 MoE on an H100-class card at ~20-40% MFU); an assumption.
TRAIN_FLOPS_PER_GPU = 2.0e14
SERVER_CONCURRENCY = 16  # rollout.server_concurrency unset: the old client-wide default, now per server
STOP_S = 30  # the launch script's cleanup waits this long for the servers to stop (launch/script.py)
SLURM_MAX_SIGNAL_LEAD_S = 65535  # sbatch --signal=...@sig_time: at most 65535 s
DISK_SYNC_WARN_S = 10  # a disk weight sync taking this long per step is printed as a warning
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Derived:
    """A key's value: the config's when set (``derived`` False), else the plan's; ``why`` is the derivation."""

    key: str
    value: float
    why: str
    derived: bool

    def line(self) -> str:
        if self.derived:
            return f"{self.key}={self.value:g} (derived: {self.why})"
        return f"{self.key}={self.value:g} (set in the config; the plan's value: {self.why})"


def _resolve(key: str, given: float | None, plan_value: float, why: str) -> Derived:
    if given is None:
        return Derived(key, plan_value, why, True)
    return Derived(key, given, f"{plan_value:g} = {why}", False)


def server_load_bytes(cfg: ExperimentConfig) -> float:
    """Bytes one rollout server reads at start: the whole model's HF checkpoint in bf16 (``terms.HF_BYTES``)."""
    return float(terms.total_params(cfg) * terms.HF_BYTES)


def startup_timeout(cfg: ExperimentConfig) -> Derived:
    """``rollout.startup_timeout_s``: 180 s + the bytes each server loads / ``launch.fs_bandwidth_gb_s``."""
    nbytes, fs = server_load_bytes(cfg), cfg.launch.fs_bandwidth_gb_s
    load = math.ceil(nbytes / (fs * GB))
    why = (
        f"{STARTUP_BASE_S} s + {_gb(nbytes)} of bf16 HF weights each server loads at launch.fs_bandwidth_gb_s={fs:g} "
        f"({load} s)"
    )
    return _resolve("rollout.startup_timeout_s", cfg.rollout.startup_timeout_s, STARTUP_BASE_S + load, why)


def request_timeout(cfg: ExperimentConfig) -> Derived:
    """``rollout.request_timeout_s``: 120 s + ``rollout.max_new_tokens`` at ``MIN_DECODE_TOKENS_PER_S``."""
    r = cfg.rollout
    decode = math.ceil(r.max_new_tokens / MIN_DECODE_TOKENS_PER_S)
    why = (
        f"{REQUEST_BASE_S} s + rollout.max_new_tokens={r.max_new_tokens} at {MIN_DECODE_TOKENS_PER_S} tokens/s "
        f"({decode} s); a request still running at the bound is aborted on its server and continued from the "
        "tokens it generated (not sent again from its start)"
    )
    return _resolve("rollout.request_timeout_s", r.request_timeout_s, REQUEST_BASE_S + decode, why)


def client_concurrency(cfg: ExperimentConfig, servers: int | None = None) -> Derived:
    """``rollout.max_concurrency`` (requests in flight, all servers together): when unset,
    ``rollout.server_concurrency`` (default ``SERVER_CONCURRENCY``) x the servers (``servers``: the client's own
    address count; default the config's: ``launch.rollout_nodes``, or ``rollout.addresses``)."""
    r = cfg.rollout
    servers = _servers(cfg) if servers is None else servers
    per = SERVER_CONCURRENCY if r.server_concurrency is None else r.server_concurrency
    source = "default" if r.server_concurrency is None else "set"
    why = (
        f"rollout.server_concurrency={per} ({source}) per server x {servers} server(s); SGLang batches the requests "
        "each server holds, so the client keeps each one busy (slime's --sglang-server-concurrency)"
    )
    return _resolve("rollout.max_concurrency", r.max_concurrency, per * servers, why)


def sync_mode(cfg: ExperimentConfig) -> str:
    """The weight-sync mode the launch layout gets: ``rollout.weight_sync``, with ``auto`` as the sync resolves
    it (``disk`` when a server is on another host: the launch's own servers run on their own nodes)."""
    r = cfg.rollout
    if r.weight_sync != "auto":
        return r.weight_sync
    remote = cfg.launch.rollout_nodes > 0 or any(_host(a) not in _LOOPBACK for a in r.addresses)
    return "disk" if remote else "tensor"


def _host(address: str) -> str:
    return urlsplit(address if "://" in address else f"http://{address}").hostname or ""


def _servers(cfg: ExperimentConfig) -> int:
    return cfg.launch.rollout_nodes or max(len(cfg.rollout.addresses), 1)


def disk_sync(cfg: ExperimentConfig) -> tuple[float, float, float]:
    """A disk sync's ``(bytes written, bytes read, seconds)`` per step: every learner rank writes its share of the
    bf16 export (the learner nodes at ``launch.fs_bandwidth_gb_s`` each), then every server reads all of it (each
    at its node's bandwidth, at once)."""
    nbytes, fs, ln = server_load_bytes(cfg), cfg.launch.fs_bandwidth_gb_s, cfg.launch
    seconds = nbytes / (ln.learner_nodes * fs * GB) + nbytes / (fs * GB)
    return nbytes, _servers(cfg) * nbytes, seconds


def _sync_seconds(cfg: ExperimentConfig) -> tuple[float, str]:
    mode = sync_mode(cfg)
    if mode == "disk":
        written, read, seconds = disk_sync(cfg)
        return seconds, f"disk: {_gb(written)} written + {_gb(read)} read"
    nbytes, net = server_load_bytes(cfg), cfg.launch.network_bandwidth_gb_s
    return nbytes / (net * GB), f"{mode}: {_gb(nbytes)} at launch.network_bandwidth_gb_s={net:g}"


def _active_params(cfg: ExperimentConfig) -> float:
    """Parameters one token runs through: the dense ones and ``moe_router_topk`` experts of each MoE layer (one
    rank of tp = pp = etp = 1, ep = ``num_moe_experts``: one expert per MoE layer)."""
    m, p = cfg.model, cfg.parallel
    experts = max(m.num_moe_experts, 2)  # ep > 1: local_params counts the experts apart
    one = {"tp": 1, "pp": 1, "ep": experts, "etp": 1, "cp": 1}
    params = local_params(cfg.model_copy(update={"parallel": p.model_copy(update=one)}), 0)
    return float(params.dense + min(m.moe_router_topk, m.num_moe_experts) * params.expert)


def step_time(cfg: ExperimentConfig, world: int) -> tuple[float, dict[str, float], dict[str, str]]:
    """One step's seconds (an estimate: ``[GPU check pending]``) and its parts with their derivations.

    generation: ``prompts_per_step x samples_per_prompt`` requests, ``rollout.max_concurrency`` at a time, each
    ``max_new_tokens`` at ``DECODE_TOKENS_PER_S``; training: (6 + 2 under ``recompute: full``) x active params x
    the step's tokens x ``epochs_per_step``, + 2 x for the old-log-prob pass (``correction.mode: decoupled``), at
    ``TRAIN_FLOPS_PER_GPU`` per rank; the weight sync at the plan's bandwidths. Async mode overlaps generation
    with training.
    """
    r, t = cfg.rollout, cfg.train
    requests, concurrency = t.prompts_per_step * r.samples_per_prompt, int(client_concurrency(cfg).value)
    waves = math.ceil(requests / concurrency)
    generation = waves * r.max_new_tokens / DECODE_TOKENS_PER_S
    tokens = requests * terms.sample_tokens(cfg)
    per_token = (6 + (2 if t.recompute == "full" else 0)) * t.epochs_per_step
    per_token += 2 if cfg.correction.mode == "decoupled" else 0
    training = per_token * _active_params(cfg) * tokens / (world * TRAIN_FLOPS_PER_GPU)
    sync, sync_why = _sync_seconds(cfg)
    parts = {"generation": generation, "training": training, "weight sync": sync}
    whys = {
        "generation": (
            f"{requests} requests, rollout.max_concurrency={concurrency} at a time, "
            f"{r.max_new_tokens} tokens at ~{DECODE_TOKENS_PER_S} tokens/s each"
        ),
        "training": f"{per_token} x {_count(_active_params(cfg))} active params x {tokens} tokens on {world} GPUs",
        "weight sync": sync_why,
    }
    total = (max(generation, training) if t.rollout_mode == "async" else generation + training) + sync
    return total, parts, whys


def save_time(cfg: ExperimentConfig, world: int) -> tuple[float, float]:
    """``(bytes per node, seconds)`` of one checkpoint save at ``launch.fs_bandwidth_gb_s``."""
    per_node = cfg.launch.gpus_per_node * max(r.checkpoint_bytes for r in job_plan(cfg, world).ranks)
    return per_node, per_node / (cfg.launch.fs_bandwidth_gb_s * GB)


def signal_lead(cfg: ExperimentConfig, world: int | None = None) -> Derived:
    """``launch.signal_lead_s``: the plan's step + save + stop time, whole seconds (world: the launch layout's)."""
    world = launch_world(cfg) if world is None else world
    step, parts, _ = step_time(cfg, world)
    per_node, save = save_time(cfg, world)
    need = math.ceil(step + save + STOP_S)
    why = (
        f"step ~{step:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in parts.items())}) + save {save:.0f} s "
        f"({_gb(per_node)} per node at launch.fs_bandwidth_gb_s={cfg.launch.fs_bandwidth_gb_s:g}) + stop {STOP_S} s"
    )
    return _resolve("launch.signal_lead_s", cfg.launch.signal_lead_s, need, why)


def signal_lead_fits(cfg: ExperimentConfig) -> Iterable[str]:
    """Preflight rule: ``launch.signal_lead_s`` covers the plan's step + save + stop, within SLURM's limit."""
    ln = cfg.launch
    world = launch_world(cfg)
    if ln.signal is None or world is None:  # no warning; the launch rules name a world that does not fit
        return
    plan = signal_lead(_unset_lead(cfg), world)
    _, save = save_time(cfg, world)
    if ln.signal_lead_s is not None and ln.signal_lead_s < plan.value:
        yield (
            f"launch.signal_lead_s={ln.signal_lead_s} is shorter than the plan's step + save + stop, {plan.value:g} s "
            f"(the checkpoint save alone takes {save:.0f} s; {plan.why}); expected at least {plan.value:g}: leave "
            "launch.signal_lead_s unset (derived), or shorten the step (rollout.max_concurrency sets the generation "
            "term) or the save (launch.fs_bandwidth_gb_s, if the filesystem is faster); "
            "launch.signal=null sends no warning: the time limit's SIGTERM then ends the job, which loses the step "
            f"in progress and every step since the last checkpoint (checkpoint.save_interval="
            f"{cfg.checkpoint.save_interval})"
        )
        return
    value = plan.value if ln.signal_lead_s is None else ln.signal_lead_s
    if value > SLURM_MAX_SIGNAL_LEAD_S:
        yield (
            f"launch.signal_lead_s={value:g} ({'set' if ln.signal_lead_s else 'derived: step + save + stop'}) exceeds "
            f"SLURM's {SLURM_MAX_SIGNAL_LEAD_S} s for sbatch --signal; expected at most {SLURM_MAX_SIGNAL_LEAD_S}: "
            "a shorter step (rollout.max_concurrency, train.prompts_per_step) or launch.signal=null"
        )


def _unset_lead(cfg: ExperimentConfig) -> ExperimentConfig:
    return cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"signal_lead_s": None})})


def derived_lines(cfg: ExperimentConfig) -> list[str]:
    """What the dry-run prints: each derived (or set) value and why, and the disk-sync warning."""
    out = ["derived defaults (unset keys take the plan's values; moe_rl/sizing/defaults.py):"]
    out += [f"  {d.line()}" for d in (startup_timeout(cfg), request_timeout(cfg), client_concurrency(cfg))]
    world = launch_world(cfg)
    if cfg.launch.signal is None:
        out.append(
            "  launch.signal=null: no warning before the time limit; SLURM's SIGTERM there ends the job, losing the "
            f"step in progress and every step since the last checkpoint (checkpoint.save_interval="
            f"{cfg.checkpoint.save_interval}); a plain scontrol requeue resumes from that checkpoint"
        )
    elif world is not None:
        out.append(f"  {signal_lead(cfg, world).line()} [GPU check pending]")
    if sync_mode(cfg) == "disk":
        written, read, seconds = disk_sync(cfg)
        if seconds >= DISK_SYNC_WARN_S:
            out.append(
                f"warning: rollout.weight_sync={cfg.rollout.weight_sync} syncs through the shared filesystem "
                f"(disk) at every step: {_gb(written)} written + {_gb(read)} read ({_servers(cfg)} servers), "
                f"~{seconds:.0f} s per step at launch.fs_bandwidth_gb_s={cfg.launch.fs_bandwidth_gb_s:g}; "
                "rollout.weight_sync=distributed sends it over the network instead"
            )
    return out


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.05 * GB else f"{nbytes / 1e6:.2f} MB"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"
