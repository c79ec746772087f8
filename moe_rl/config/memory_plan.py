"""Memory plan of a learner layout: bytes per GPU (and per node) before anything starts.

Owns the arithmetic only: the parameters each rank holds (from the model and parallel sections,
counted as Megatron-Core 0.16.1 builds them), the bytes Megatron keeps for them (weights,
gradient buffer, optimizer state as ``optim.use_distributed_optimizer`` / ``optimizer_cpu_offload`` /
``use_precision_aware_optimizer`` lay it out), an activation estimate, the host bytes a checkpoint
save writes per node, and the preflight rule that refuses a layout whose state alone exceeds
``launch.gpu_memory_gb``. Where each byte count comes from is cited in docs/launch.md ("Memory
plan"). It must not import torch or Megatron: ``config validate`` runs it on any machine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from moe_rl.config.schema import ExperimentConfig

GB = 1e9  # launch.gpu_memory_gb and every printed figure: 10^9 bytes
_PARAM_BYTES = {"float32": 4, "bfloat16": 2}
GRAD_BYTES = 4  # the learner's DDP reduces in fp32 (grad_reduce_in_fp32=True, moe_rl.learner.optimizer.wrap_ddp)


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of pipeline stage ``stage`` holds: ``dense`` are reduced over dp, ``expert`` over edp."""

    stage: int
    dense: int
    expert: int


def local_params(cfg: ExperimentConfig, stage: int) -> StageParams:
    """Elements of every parameter a rank of ``stage`` holds (tp / etp / ep shares, as GPTModel builds them).

    Norm weights and the router are replicated over tp (counted whole); the embedding and the
    (untied) output layer are split over tp by vocabulary, on the first and last stage. Megatron marks
    expert weights as expert-parallel (reduced over expert dp) only when ``ep > 1``
    (transformer/moe/experts.py: ``expert_parallel = expert_model_parallel_size > 1``); at ep = 1 they
    are reduced and sharded with the dense params, and are counted there.
    """
    m, p = cfg.model, cfg.parallel
    tp, etp, pp = p.tp, (p.tp if p.etp is None else p.etp), p.pp
    h, kv = m.hidden_size, m.kv_channels
    qkv_out = kv * (m.num_attention_heads + 2 * m.num_query_groups)
    attention = (qkv_out * h + (qkv_out if m.add_qkv_bias else 0) + m.num_attention_heads * kv * h) // tp
    norms = 2 * h + (2 * kv if m.qk_layernorm else 0)  # input / pre-MLP RMSNorm, q / k layernorm
    dense_mlp = 3 * h * m.ffn_hidden_size // tp  # SwiGLU: fc1 [2F, h] + fc2 [h, F]
    shared = 3 * h * m.moe_shared_expert_intermediate_size // tp if m.moe_shared_expert_intermediate_size else 0
    router = m.num_moe_experts * h
    experts = m.num_moe_experts // p.ep * (3 * h * m.moe_ffn_hidden_size // etp)
    per_stage = m.num_layers // pp
    pattern = m.moe_layer_pattern()[stage * per_stage : (stage + 1) * per_stage]
    dense = sum(attention + norms + (shared + router if moe else dense_mlp) for moe in pattern)
    expert = sum(experts for moe in pattern if moe)
    vocab = m.vocab_size * h // tp
    if stage == 0:
        dense += vocab  # word embeddings
    if stage == pp - 1:
        dense += vocab + h  # output layer + final RMSNorm
    if p.ep == 1:
        dense, expert = dense + expert, 0
    return StageParams(stage, dense, expert)


def data_parallel_sizes(cfg: ExperimentConfig, world: int) -> tuple[int, int]:
    """``(dp, edp)`` as Megatron's parallel_state derives them: world / (tp*pp*cp), world / (etp*ep*pp)."""
    p = cfg.parallel
    etp = p.tp if p.etp is None else p.etp
    return world // (p.tp * p.pp * p.cp), world // (etp * p.ep * p.pp)


@dataclass(frozen=True)
class OptimizerBytes:
    """Bytes of optimizer state per parameter element before sharding: on the GPU and on the host."""

    gpu: float
    host: float


def optimizer_bytes_per_element(cfg: ExperimentConfig) -> OptimizerBytes:
    """Megatron-Core 0.16.1's optimizer state per parameter element (divide by the shard count).

    * Not distributed: Float16Optimizer keeps an fp32 master (bf16 params) and Adam's two fp32
      moments; fp32 params are their own master.
    * Distributed (distrib_optimizer.py ``_build_model_and_main_param_groups``): the same, on this
      rank's 1/dp shard. With ``use_precision_aware_optimizer`` and no offload, TE's FusedAdam holds the
      master as the 16-bit remainder of the bf16 param (``store_param_remainders``, default True; fp32
      params: counted as a 4-byte master, not checked). 0.16.1 accepts precision-aware only with
      Transformer Engine installed, offload or not (``is_te_min_version`` raises without it).
    * Offload (cpu_offloading/hybrid_optimizer.py, ``param_update_in_fp32=True``): the offloaded share
      lives on the host as an fp32 param copy, fp32 grad copy and two fp32 moments (16 bytes); the GPU
      share keeps the moments plus an fp32 copy of bf16 params. Without precision-aware the
      distributed optimizer's fp32 master stays on the GPU for every element.
    """
    o = cfg.optim
    bf16 = cfg.precision.params_dtype == "bfloat16"
    if not o.use_distributed_optimizer:
        return OptimizerBytes(gpu=(4 if bf16 else 0) + 8, host=0.0)
    if not o.optimizer_cpu_offload:
        master = (2 if bf16 else 4) if o.use_precision_aware_optimizer else (4 if bf16 else 0)
        return OptimizerBytes(gpu=master + 8, host=0.0)
    f = o.optimizer_offload_fraction
    if o.use_precision_aware_optimizer:
        return OptimizerBytes(gpu=(1 - f) * (8 + (4 if bf16 else 0)), host=16 * f)
    return OptimizerBytes(gpu=(4 if bf16 else 0) + (1 - f) * 8, host=16 * f)


@dataclass(frozen=True)
class RankMemory:
    """One GPU of pipeline stage ``stage``: bytes of each kind (host: offloaded optimizer state)."""

    stage: int
    dense_params: int
    expert_params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    host_optimizer: float
    checkpoint_host: float  # bytes this rank writes in a checkpoint save (its own state)

    @property
    def state(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations


def activation_bytes(cfg: ExperimentConfig, stage: int, tokens: int | None = None, logit_bytes: float = 6.0) -> float:
    """Estimate of one GPU's activations: ``tokens`` (default ``model.seq_length`` x ``train.micro_batch_size``).

    Per layer and token, Korthikanti et al. 2022 (arXiv 2205.05198, section 4.1) count 11h bytes for attention
    (the 5as/h softmax term dropped: flash attention), 4h for the two norms, and for the MLP we count the
    gated expert path per routed copy (2h input, 4F gate/up output, 2F activation, 2F product) with
    ``moe_router_topk`` copies (plus the shared expert), all divided by tp (sequence parallelism).
    ``train.recompute: full`` keeps only each layer's bf16 input (2h) plus one layer's working set.
    Under pp, stage s holds pp - s microbatches in flight (1F1B). Logits: bf16 plus an fp32 copy of the
    vocab shard (the learner upcasts once for log-probs and entropy), ``logit_bytes`` per element; the job
    plan (``moe_rl.sizing``) passes the real micro-batch tokens and 0 here, and counts the logits itself.
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = m.seq_length * t.micro_batch_size if tokens is None else tokens
    h, tp = m.hidden_size, p.tp
    shared = m.moe_shared_expert_intermediate_size or 0
    attention = 11 * h + 4 * h
    moe_mlp = m.moe_router_topk * (2 * h + 8 * m.moe_ffn_hidden_size) + (2 * h + 8 * shared if shared else 0)
    layer = (attention + max(moe_mlp, 2 * h + 8 * m.ffn_hidden_size)) / tp * tokens
    layers = m.num_layers // p.pp
    in_flight = p.pp - stage
    if t.recompute == "full":
        stored = layers * 2 * h / tp * tokens * in_flight + layer
    else:
        stored = layers * layer * in_flight
    logits = tokens * m.vocab_size / tp * logit_bytes if stage == p.pp - 1 else 0
    return stored + logits


def rank_memory(cfg: ExperimentConfig, world: int, stage: int) -> RankMemory:
    params = local_params(cfg, stage)
    dp, edp = data_parallel_sizes(cfg, world)
    pbytes = _PARAM_BYTES[cfg.precision.params_dtype]
    opt = optimizer_bytes_per_element(cfg)
    shards = (dp, edp) if cfg.optim.use_distributed_optimizer else (1, 1)
    per_shard = params.dense / shards[0] + params.expert / shards[1]
    n = params.dense + params.expert
    # A save writes every global element once, each replica's share byte-balanced over the (expert-)data-parallel
    # ranks (learner/ownership.py ``writes_whole``; with the distributed optimizer each rank its own shard): weights,
    # fp32 master (bf16 params) and moments of ``dense / dp + expert / edp`` elements (measured within 1% at ep=2
    # and dp=2, tests/distributed/test_memory_plan_ranks.py).
    master_and_moments = (4 if pbytes == 2 else 0) + 8
    checkpoint = (params.dense / dp + params.expert / edp) * (pbytes + master_and_moments)
    return RankMemory(
        stage=stage,
        dense_params=params.dense,
        expert_params=params.expert,
        weights=n * pbytes,
        grads=n * GRAD_BYTES,
        optimizer=per_shard * opt.gpu,
        activations=activation_bytes(cfg, stage),
        host_optimizer=per_shard * opt.host,
        checkpoint_host=checkpoint,
    )


@dataclass(frozen=True)
class MemoryPlan:
    world: int
    world_from: str
    dp: int
    edp: int
    gpu_memory_gb: float
    gpus_per_node: int
    ranks: tuple[RankMemory, ...]  # one per pipeline stage
    optimizer_words: str
    recompute: bool

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.state)

    def lines(self) -> list[str]:
        """The per-GPU lines ``config validate`` and ``launch --dry-run`` print (worst pipeline stage)."""
        w, node = self.worst, self.gpus_per_node
        stage = f", pipeline stage {w.stage} of {len(self.ranks)}" if len(self.ranks) > 1 else ""
        head = (
            f"memory plan per GPU ({self.world} learner ranks from {self.world_from}: dp {self.dp}, expert dp "
            f"{self.edp}{stage}; {_count(w.dense_params)} dense + {_count(w.expert_params)} expert params):"
        )
        recompute = "full" if self.recompute else "none"
        return [
            head,
            f"  weights          {_size(w.weights)}",
            f"  gradients        {_size(w.grads)} (fp32 reduction buffer)",
            f"  optimizer state  {_size(w.optimizer)} ({self.optimizer_words})",
            f"  state total      {_size(w.state)} of launch.gpu_memory_gb={self.gpu_memory_gb:g}",
            f"  activations     ~{_size(w.activations)} (estimate: seq_length x micro_batch_size tokens, recompute="
            + f"{recompute})",
            f"per node ({node} GPUs): host optimizer state {_size(node * w.host_optimizer).strip()}; a checkpoint save "
            + f"writes {_size(node * w.checkpoint_host).strip()} from host memory (each rank its own state)",
        ]


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:8.1f} GB" if nbytes >= 0.05 * GB else f"{nbytes / 1e6:8.2f} MB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"


def memory_plan(cfg: ExperimentConfig, world: int | None = None) -> MemoryPlan:
    """The plan for ``world`` learner ranks (default: ``launch.learner_nodes * launch.gpus_per_node``)."""
    ln = cfg.launch
    if world is None:
        world, world_from = ln.learner_nodes * ln.gpus_per_node, "launch.learner_nodes*launch.gpus_per_node"
    else:
        world_from = "the process count"
    dp, edp = data_parallel_sizes(cfg, world)
    ranks = tuple(rank_memory(cfg, world, s) for s in range(cfg.parallel.pp))
    return MemoryPlan(
        world,
        world_from,
        dp,
        edp,
        ln.gpu_memory_gb,
        ln.gpus_per_node,
        ranks,
        describe_optimizer(cfg, dp, edp),
        cfg.train.recompute == "full",
    )


def describe_optimizer(cfg: ExperimentConfig, dp: int, edp: int) -> str:
    o = cfg.optim
    if not o.use_distributed_optimizer:
        return "not distributed: every data-parallel replica holds all of it"
    words = f"distributed: dense / dp {dp}, experts / expert dp {edp}"
    if o.optimizer_cpu_offload:
        words += f"; {o.optimizer_offload_fraction:.0%} offloaded to the host"
    if o.use_precision_aware_optimizer:
        words += "; precision-aware"
    return words


def launch_world(cfg: ExperimentConfig) -> int | None:
    """``launch.learner_nodes * launch.gpus_per_node`` when the parallel sizes divide it, else None."""
    p, ln = cfg.parallel, cfg.launch
    world = ln.learner_nodes * ln.gpus_per_node
    etp = p.tp if p.etp is None else p.etp
    return world if world % (p.tp * p.pp * p.cp) == 0 and world % (etp * p.ep * p.pp) == 0 else None


def memory_fits(cfg: ExperimentConfig) -> Iterable[str]:
    """Preflight rule: weights + gradients + optimizer state of the fullest GPU fit ``launch.gpu_memory_gb``."""
    world = launch_world(cfg)
    if world is None:  # the launch plan and process-count rules say why
        return
    plan = memory_plan(cfg, world)
    r = plan.worst
    if r.state <= plan.gpu_memory_gb * GB:
        return
    yield (
        f"launch.gpu_memory_gb={plan.gpu_memory_gb:g}: the learner state alone needs {r.state / GB:.1f} GB per GPU "
        f"(weights {r.weights / GB:.1f} + gradients {r.grads / GB:.1f} + optimizer {r.optimizer / GB:.1f} GB, "
        f"{plan.world} ranks, dp {plan.dp}, expert dp {plan.edp}; {describe_optimizer(cfg, plan.dp, plan.edp)}), "
        f"before activations; expected at most {plan.gpu_memory_gb:g} GB: " + "; ".join(_fixes(cfg, plan))
    )


def _fixes(cfg: ExperimentConfig, plan: MemoryPlan) -> list[str]:
    """The keys that would bring the state under the limit, each with what it gives."""
    o, fixes, limit = cfg.optim, [], plan.gpu_memory_gb * GB

    def state_with(**optim) -> float:
        trial = cfg.model_copy(update={"optim": cfg.optim.model_copy(update=optim)})
        return memory_plan(trial, plan.world).worst.state

    steps = []
    if not o.use_distributed_optimizer:
        steps.append(("optim.use_distributed_optimizer=true", {"use_distributed_optimizer": True}))
    if not o.optimizer_cpu_offload or o.optimizer_offload_fraction < 1:
        steps.append(
            (
                "optim.optimizer_cpu_offload=true with optim.optimizer_offload_fraction=1",
                {"use_distributed_optimizer": True, "optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0},
            )
        )
        steps.append(
            (
                "optim.optimizer_cpu_offload=true, optim.optimizer_offload_fraction=1 and "
                + "optim.use_precision_aware_optimizer=true",
                {
                    "use_distributed_optimizer": True,
                    "optimizer_cpu_offload": True,
                    "optimizer_offload_fraction": 1.0,
                    "use_precision_aware_optimizer": True,
                },
            )
        )
    for words, change in steps:
        need = state_with(**change)
        fixes.append(f"{words} gives {need / GB:.1f} GB" + ("" if need <= limit else " (not enough)"))
    fixes.append(
        "more learner GPUs (launch.learner_nodes) shard the optimizer further; parallel.etp / parallel.ep / "
        "parallel.pp split the weights and gradients"
    )
    return fixes
