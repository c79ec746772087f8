"""Preflight rules of the learner: what the Megatron-Core build, its optimizer and its process layout refuse.

Owns the config rules the learner build and the training loop would raise on (multi-token prediction,
Keep Sampling Mask entropy under tp, context parallelism, pipeline stages without a MoE layer, sizes not
divisible by their tensor-parallel shards, distributed-optimizer options that need each other, the one
optimizer layout checkpoints cannot save yet) and the environment rules of this machine and process (the
process count vs the parallel sizes; Transformer Engine, FP8, the precision-aware optimizer, CPU offload and a
GPU where the config asks for them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from moe_rl.config import ExperimentConfig
from moe_rl.learner.fp8 import fp8_runtime_missing
from moe_rl.learner.model import use_transformer_engine

__all__ = ["accelerator", "learner_features", "optimizer_options", "pipeline_stages", "process_count"]


def learner_features(cfg: ExperimentConfig) -> Iterable[str]:
    """What the learner build and the training loop refuse (moe_rl.learner.model, trainer)."""
    m, p = cfg.model, cfg.parallel
    if m.mtp_num_layers:
        yield (
            f"model.mtp_num_layers={m.mtp_num_layers}: multi-token prediction layers are neither built by the "
            "learner nor exported to SGLang; expected 0"
        )
    if cfg.ksm_active and p.tp > 1 and cfg.loss.entropy_coef:
        yield (
            f"replay.keep_sampling_mask=true with parallel.tp={p.tp} and loss.entropy_coef={cfg.loss.entropy_coef}: "
            "the kept-set entropy is not computed on vocab-sharded logits yet (the kept-set log-prob is); "
            "expected loss.entropy_coef=0 or parallel.tp=1"
        )
    yield from pipeline_stages(cfg)
    if p.cp > 1:
        yield f"parallel.cp={p.cp}: the training loop does not split sequences over context parallelism; expected 1"
    etp = p.tp if p.etp is None else p.etp
    for key, value, split in (
        ("model.vocab_size", m.vocab_size, p.tp),
        ("model.ffn_hidden_size", m.ffn_hidden_size, p.tp),
        ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size, etp),
    ):
        if value % split:
            yield f"{key}={value} must be divisible by the {split} tensor-parallel shards it is split into (parallel.tp/etp)"


def optimizer_options(cfg: ExperimentConfig) -> Iterable[str]:
    """Megatron-Core's distributed-optimizer options that need each other (optimizer_config.py asserts, or
    the option has no effect): offload and precision-aware state live in the distributed optimizer."""
    o = cfg.optim
    for key, on in (
        ("optim.optimizer_cpu_offload", o.optimizer_cpu_offload),
        ("optim.use_precision_aware_optimizer", o.use_precision_aware_optimizer),
    ):
        if on and not o.use_distributed_optimizer:
            yield (
                f"{key}=true needs optim.use_distributed_optimizer=true (Megatron-Core keeps offloaded and "
                "lower-precision optimizer state only in its distributed optimizer)"
            )
    if o.optimizer_offload_fraction != 1.0 and not o.optimizer_cpu_offload:
        yield (
            f"optim.optimizer_offload_fraction={o.optimizer_offload_fraction} has no effect without "
            "optim.optimizer_cpu_offload=true; expected 1.0 or offload on"
        )
    saves_midway = cfg.checkpoint.save_interval > 0 or cfg.launch.signal is not None
    if o.use_distributed_optimizer and o.use_precision_aware_optimizer and not o.optimizer_cpu_offload and saves_midway:
        # the layouts that save: no offload, offload alone, offload + precision-aware (learner.global_state)
        yield (
            "optim.use_precision_aware_optimizer=true without optim.optimizer_cpu_offload: Transformer Engine's "
            "FusedAdam keeps the master weights and moments inside itself, a layout checkpoints cannot save yet, "
            f"and checkpoint.save_interval={cfg.checkpoint.save_interval} / launch.signal={cfg.launch.signal} "
            "would save mid-run; expected optim.optimizer_cpu_offload=true, use_precision_aware_optimizer=false, "
            "or checkpoint.save_interval=0 and launch.signal=null (then only the save after the last step fails)"
        )


def pipeline_stages(cfg: ExperimentConfig) -> Iterable[str]:
    """pp > 1 (equal stages: the schema checks ``num_layers % pp``): every stage holds at least one MoE layer
    (routing replay and the dispatch probe bind per stage), and the dispatcher accepts ragged microbatches."""
    m, pp = cfg.model, cfg.parallel.pp
    if pp == 1:
        return
    if m.num_layers % pp:  # the schema refuses it ("parallel.pp=... must divide model.num_layers=...")
        return
    if m.moe_token_dispatcher_type == "allgather":
        yield (
            f"model.moe_token_dispatcher_type='allgather' with parallel.pp={pp}: Megatron-Core refuses the "
            "allgather dispatcher with variable_seq_lengths, which pipeline stages need for ragged microbatches; "
            "expected 'alltoall'"
        )
    per_stage = m.num_layers // pp
    pattern = m.moe_layer_pattern()
    dense = [s for s in range(pp) if not any(pattern[s * per_stage : (s + 1) * per_stage])]
    if dense:
        yield (
            f"parallel.pp={pp}: pipeline stage(s) {dense} would hold only dense layers "
            f"(model.first_k_dense_layers={m.first_k_dense_layers}, model.moe_layer_freq={m.moe_layer_freq}, "
            f"{per_stage} decoder layer(s) per stage); expected every stage to hold a MoE layer: "
            "lower parallel.pp"
        )


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
    if cfg.parallel.tp > 1 and not use_transformer_engine():
        yield (
            f"parallel.tp={cfg.parallel.tp} needs Transformer Engine on a GPU (Megatron-Core trains MoE with tp > 1 "
            "only under sequence parallelism); expected parallel.tp=1 on this machine"
        )
    if cfg.precision.fp8 is not None:
        missing = fp8_runtime_missing()
        if missing:
            yield f"precision.fp8 needs {' and '.join(missing)}; expected precision.fp8=null on this machine"
    o = cfg.optim
    if o.use_precision_aware_optimizer and not o.optimizer_cpu_offload and not use_transformer_engine():
        yield (
            "optim.use_precision_aware_optimizer=true without optim.optimizer_cpu_offload needs Transformer "
            "Engine's FusedAdam on a GPU; expected false on this machine"
        )
    if o.optimizer_cpu_offload and not torch.cuda.is_available():
        yield (
            "optim.optimizer_cpu_offload=true moves the optimizer state from the GPU to the host, and this "
            "machine has none; expected false on this machine"
        )
    if not cfg.rollout.addresses and cfg.rollout.device == "cuda" and not torch.cuda.is_available():
        yield "rollout.device='cuda' launches SGLang on a GPU, and this machine has none; expected rollout.device='cpu'"
