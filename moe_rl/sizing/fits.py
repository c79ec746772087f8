"""Preflight rule of the job plan: the GPU total and the host total per node fit their limits.

Owns ``job_fits``: refuses a layout whose fullest GPU's total (state, FP8 caches, activations, logits,
CUDA/NCCL overhead) exceeds ``launch.gpu_memory_gb``, or whose host total per node exceeds
``launch.host_memory_gb`` when that is set, naming the largest terms and the keys that would fix it (each
tried on a copy of the config). When the state alone exceeds the GPU, ``memory_plan.memory_fits`` says so. It
also runs ``defaults.signal_lead_fits`` (a ``launch.signal_lead_s`` under the plan's step + save + stop).
"""

from __future__ import annotations

from collections.abc import Iterable

from moe_rl.config.memory_plan import GB, launch_world, memory_fits
from moe_rl.config.schema import ExperimentConfig
from moe_rl.sizing.defaults import signal_lead_fits
from moe_rl.sizing.plan import JobPlan, job_plan

_GPU_WORDS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "fp8_cache": "FP8 caches",
    "activations": "activations",
    "logits": "logits",
    "overhead": "CUDA/NCCL",
}
_HOST_WORDS = {
    "offloaded_optimizer": "offloaded optimizer",
    "hf_import": "HF import peak",
    "records": "records",
    "checkpoint_buffer": "save buffer",
}


def job_fits(cfg: ExperimentConfig) -> Iterable[str]:
    """Preflight rule: the job plan's GPU total (and host total, with ``launch.host_memory_gb``) fit."""
    world = launch_world(cfg)
    if world is None:  # the launch plan and process-count rules say why
        return
    state_problems = list(memory_fits(cfg))
    yield from state_problems
    plan, ln = job_plan(cfg, world), cfg.launch
    r = plan.worst
    if not state_problems and r.gpu_total > ln.gpu_memory_gb * GB:
        yield (
            f"launch.gpu_memory_gb={ln.gpu_memory_gb:g}: the fullest GPU needs {r.gpu_total / GB:.1f} GB "
            f"(largest terms: {_largest(r.gpu, _GPU_WORDS)}; {plan.world} ranks); expected at most "
            f"{ln.gpu_memory_gb:g} GB: " + "; ".join(_gpu_fixes(cfg, plan))
        )
    yield from signal_lead_fits(cfg)
    if ln.host_memory_gb is None:
        return
    h, node = plan.worst_host, ln.gpus_per_node
    if node * h.host_total > ln.host_memory_gb * GB:
        per_node = {k: node * v for k, v in h.host.items()}
        yield (
            f"launch.host_memory_gb={ln.host_memory_gb:g}: a learner node needs {node * h.host_total / GB:.1f} GB "
            f"of host memory ({node} ranks; largest terms: {_largest(per_node, _HOST_WORDS)}); expected at most "
            f"{ln.host_memory_gb:g} GB: " + "; ".join(_host_fixes(cfg, plan))
        )


def _largest(terms: dict[str, float], words: dict[str, str], n: int = 4) -> str:
    top = sorted(terms.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{words[k]} {v / GB:.1f} GB" for k, v in top)


def _with(cfg: ExperimentConfig, section: str, **update) -> ExperimentConfig:
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=update)})


def _gpu_fixes(cfg: ExperimentConfig, plan: JobPlan) -> list[str]:
    trials = []
    fp8 = cfg.precision.fp8
    if fp8 is not None and not fp8.disable_parameter_transpose_cache:
        trial = _with(cfg, "precision", fp8=fp8.model_copy(update={"disable_parameter_transpose_cache": True}))
        trials.append(("precision.fp8.disable_parameter_transpose_cache=true", trial))
    if cfg.train.micro_batch_size > 1:
        trials.append(("train.micro_batch_size=1", _with(cfg, "train", micro_batch_size=1)))
    if cfg.train.recompute != "full":
        trials.append(("train.recompute=full", _with(cfg, "train", recompute="full")))
    fixes = []
    for words, trial in trials:
        need = job_plan(trial, plan.world).worst.gpu_total
        fixes.append(
            f"{words} gives {need / GB:.1f} GB" + ("" if need <= cfg.launch.gpu_memory_gb * GB else " (not enough)")
        )
    fixes.append(
        "parallel.tp splits the logits and activations; more learner GPUs (launch.learner_nodes) shard the optimizer"
    )
    return fixes


def _host_fixes(cfg: ExperimentConfig, plan: JobPlan) -> list[str]:
    node, fixes, limit = cfg.launch.gpus_per_node, [], cfg.launch.host_memory_gb * GB

    def enough(need: float) -> str:
        return "" if need <= limit else " (not enough)"

    doubled = _with(cfg, "launch", learner_nodes=2 * cfg.launch.learner_nodes)
    need = node * job_plan(doubled, 2 * plan.world).worst_host.host_total
    fixes.append(f"launch.learner_nodes={2 * cfg.launch.learner_nodes} gives {need / GB:.1f} GB per node{enough(need)}")
    o = cfg.optim
    if o.optimizer_cpu_offload:
        frac = 0.5 * o.optimizer_offload_fraction
        trial = job_plan(_with(cfg, "optim", optimizer_offload_fraction=frac), plan.world)
        need = node * trial.worst_host.host_total
        fixes.append(
            f"optim.optimizer_offload_fraction={frac:g} gives {need / GB:.1f} GB per node{enough(need)} (and "
            f"{trial.worst.gpu_total / GB:.1f} GB per GPU)"
        )
    fixes.append("a larger launch.host_memory_gb if the nodes have it")
    return fixes
