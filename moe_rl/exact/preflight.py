"""Preflight rules of ``rollout.true_on_policy``: every setting that cannot be exact, named.

Owns ``true_on_policy_settings(cfg)`` (a config rule of ``moe_rl.preflight``): each yielded line
names one setting the shared kernels of ``moe_rl.exact`` do not make bit-identical between the SGLang
server and the learner, and what to set instead.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["true_on_policy_settings"]

_WHY = "cannot be exact under rollout.true_on_policy"


def true_on_policy_settings(cfg) -> Iterable[str]:
    r, m, p, prec = cfg.rollout, cfg.model, cfg.parallel, cfg.precision
    if not r.true_on_policy:
        return
    if r.device != "cpu":
        yield (
            f"rollout.device={r.device!r} {_WHY}: the shared kernels are CPU kernels; SGLang's GPU kernels and "
            "Megatron/TE's are not shared yet (docs/true_on_policy.md, 'path to GPUs'); expected 'cpu'"
        )
    if r.dtype != prec.params_dtype:
        yield (
            f"rollout.dtype={r.dtype!r} with precision.params_dtype={prec.params_dtype!r} {_WHY}: both sides "
            "must round in the same dtype; set them equal"
        )
    if r.weight_quantization != "none":
        yield (
            f"rollout.weight_quantization={r.weight_quantization!r} {_WHY}: the learner trains unquantised "
            "weights; expected 'none'"
        )
    if prec.fp8 is not None:
        yield f"precision.fp8 {_WHY}: FP8 GEMMs are not among the shared kernels; expected null"
    if not r.deterministic:
        yield (
            f"rollout.deterministic=false {_WHY}: the server's log-probs come from the deterministic "
            "sampler's log_softmax(logits / t); expected true"
        )
    if r.partial and r.pause_mode == "in_place":
        yield (
            f"rollout.pause_mode='in_place' {_WHY}: a response resumed after a weight update attends over KV "
            "computed by the older weights, a forward no single learner version computes (docs/true_on_policy.md, "
            "'What cannot be exact'); use 'retract' or 'abort'"
        )
    # parallel.pp is exact: each stage runs the same per-layer kernels and the hidden states it sends are copies
    if p.tp != 1:
        yield (
            f"parallel.tp={p.tp} {_WHY} against the server yet: the exact learner at tp > 1 (sequence parallel, "
            "etp=1) combines each row-parallel linear's fp32 partials in a fixed order (TBIK), equal to the tp=1 "
            "kernel with its K split into tp blocks, but the server's split is not wired yet (the launcher does not "
            "set it and the kernel identity does not carry it; by hand a tp=2 run is exact at every step: "
            "docs/true_on_policy.md, 'Pipeline and tensor parallelism'); expected 1"
        )
    if p.cp != 1:
        yield (
            f"parallel.cp={p.cp} {_WHY}: context parallelism splits a sequence's keys over ranks and merges the "
            "ranks' partial softmax sums (ring attention) in an order the server's blocked attention over the whole "
            "sequence does not have; expected 1"
        )
    if p.etp not in (None, 1):
        yield (
            f"parallel.etp={p.etp} {_WHY}: the experts' down projections would reduce over etp ranks, a split the "
            "server's expert kernel (kernels.moe_experts) does not make; expected 1"
        )
    if m.moe_expert_capacity_factor is not None:
        yield (
            f"model.moe_expert_capacity_factor={m.moe_expert_capacity_factor} {_WHY}: token dropping depends on "
            "the batch (which tokens compete for an expert's capacity); expected null"
        )
    if m.moe_router_fusion:
        yield f"model.moe_router_fusion=true {_WHY}: TE's fused router is not among the shared kernels; expected false"
