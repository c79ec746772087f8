"""SGLang side of the true-on-policy mode: route a loaded CPU model's forward through ``kernels``.

Owns ``install(model_runner)``, called by moe_rl's SGLang patch 0013 (``model_runner.py``) after the
attention backends are built and after a weight update that builds a new model, when the server
runs with ``MOE_RL_TRUE_ON_POLICY=1`` (set by the launcher for ``rollout.true_on_policy``). It
replaces, per module instance (no SGLang class is changed):

* every unquantised linear layer's ``quant_method.apply`` and the LM head (``LogitsProcessor``)
  with ``kernels.linear`` (logits in fp32);
* every ``RMSNorm`` with ``kernels.rms_norm`` / ``add_rms_norm`` (residual added in the model dtype);
* every rotate-half ``RotaryEmbedding`` with ``kernels.rope_cos_sin`` + ``apply_rope``;
* every MoE block's ``forward_normal`` with ``router_logits`` -> ``router_route`` (routes captured for
  ``return_routed_experts`` exactly as upstream) -> ``moe_experts`` (+ the block's shared expert); dense MLP
  activations with ``swiglu``; a linear's bias (q/k/v) with ``linear_bias``;
* the torch-native attention backends' per-request SDPA with ``kernels.attention`` over the cache (decode:
  every request at once with ``kernels.attention_decode``).

* the sampler's Keep Sampling Mask log-prob (``selected_logprobs``, the sampled token renormalised over
  its kept set) with ``kernels.kept_token_logprobs`` over the kept set SGLang returns.

The sampling itself is left as is: with ``--enable-deterministic-inference`` it returns
``log_softmax(logits / t)`` (``kernels.token_logprobs``). Anything this module cannot make exact
(another attention backend, a rope variant, an expert bias, a gated shared expert) raises ``TrueOnPolicyError``
at start-up, naming the module, instead of serving inexact log-probs.
"""

from __future__ import annotations

import os

import torch

from moe_rl.exact import kernels as K
from moe_rl.exact.contract import SERVER_ENV, kernels_from_env

__all__ = ["ENV", "TrueOnPolicyError", "enabled", "install"]

ENV = "MOE_RL_TRUE_ON_POLICY"
# TBIK, not wired yet (docs/true_on_policy.md, "Pipeline and tensor parallelism"): every RowParallelLinear splits its
# K reduction into this many blocks (kernels.linear(tp_blocks=)), as a tp=N exact learner does. Not in the kernel
# identity and not set by the launcher: the preflight still refuses parallel.tp > 1 under the mode.
TP_BLOCKS_ENV = "MOE_RL_TRUE_ON_POLICY_TP_BLOCKS"
MOE = frozenset({"router", "experts"})  # the items a MoE block's forward_normal carries


class TrueOnPolicyError(RuntimeError):
    """The served model has a part the true-on-policy kernels do not cover."""


def enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


def install(runner, kernels: frozenset[str] | None = None) -> list[str]:
    """Install the exact forwards on ``runner.model`` and its attention backends; returns what was
    hooked (one line per kind). Idempotent. ``kernels``: the contract's items to install (default
    ``MOE_RL_TRUE_ON_POLICY_KERNELS``, unset = all; a subset is for ``moe-rl diagnose --attribute``)."""
    on = kernels_from_env(os.environ.get(SERVER_ENV)) if kernels is None else kernels
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import
    from sglang.srt.layers.layernorm import RMSNorm  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import
    from sglang.srt.layers.linear import RowParallelLinear  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import
    from sglang.srt.layers.logits_processor import LogitsProcessor  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import

    counts: dict[str, int] = {}

    def hooked(kind):
        counts[kind] = counts.get(kind, 0) + 1

    for name, mod in runner.model.named_modules():
        qm = getattr(mod, "quant_method", None)
        linear = isinstance(qm, UnquantizedLinearMethod) and hasattr(mod, "weight") and mod.weight.dim() == 2
        if linear and "linear" in on:
            blocks = int(os.environ.get(TP_BLOCKS_ENV, "1"))
            if blocks > 1 and isinstance(mod, RowParallelLinear):
                qm.apply = lambda layer, x, bias=None, _b=blocks: _exact_split_apply(layer, x, bias, _b)
            else:
                qm.apply = _exact_linear_apply
            hooked("linear")
        if isinstance(mod, RMSNorm):
            if "rmsnorm" in on:
                mod.forward = _rms_forward(mod, name)
                hooked("rmsnorm")
        elif isinstance(mod, RotaryEmbedding):
            if type(mod) is not RotaryEmbedding or not mod.is_neox_style:
                raise TrueOnPolicyError(f"{name}: {type(mod).__name__} (neox={mod.is_neox_style}) is not covered")
            if "attention" in on:
                mod.forward = _rope_forward(mod)
                hooked("rope")
        elif isinstance(mod, LogitsProcessor):
            if "lm_head" in on:
                mod._compute_lm_head = _lm_head
                hooked("lm_head")
        elif type(mod).__name__ == "SiluAndMul":
            if "activation" in on:
                mod.forward = K.swiglu
                hooked("swiglu")
        elif hasattr(mod, "forward_normal") and hasattr(mod, "gate") and hasattr(mod, "experts") and on & MOE:
            mod.forward_normal = _moe_forward(mod, name, router="router" in on, experts="experts" in on)
            hooked("moe")
    sampler = getattr(runner, "sampler", None)
    if "log_softmax" in on and sampler is not None:
        sampler.forward = _kept_set_sampler(sampler)
        hooked("kept_set_logprobs")
    if "attention" not in on:
        return [f"{k}: {v}" for k, v in sorted(counts.items())]
    backends = [runner.attn_backend, getattr(runner, "decode_attn_backend", None)]
    backends += list(getattr(runner, "decode_attn_backend_group", None) or [])
    for backend in {id(b): b for b in backends if b is not None}.values():
        if not isinstance(backend, TorchNativeAttnBackend):
            raise TrueOnPolicyError(
                f"attention backend {type(backend).__name__}: the true-on-policy mode needs torch_native"
            )
        backend._run_sdpa_forward_extend = _sdpa_extend
        backend._run_sdpa_forward_decode = _sdpa_decode
        hooked("attention_backend")
    return [f"{k}: {v}" for k, v in sorted(counts.items())]


def _kept_set_sampler(sampler):
    """``Sampler.forward`` whose Keep Sampling Mask log-probs are ``kernels.kept_token_logprobs`` of the logits
    as they reach the sampler, over the kept sets it returns (upstream: ``log(p_y / sum of the kept p)``, an
    order the learner cannot mirror). The stock forward still samples and builds the kept sets. A batch with a
    custom logit processor or a watermark (logits changed before the sampler) raises ``TrueOnPolicyError``: the
    copy taken here would not be what was sampled from."""
    stock = type(sampler).forward

    def forward(logits_output, sampling_info, *args, **kwargs):
        rows = sampling_info.sampling_mask_batch_indices
        if rows is None or sampling_info.is_all_greedy:  # no kept sets, or a kept set of one token (log-prob 0)
            return stock(sampler, logits_output, sampling_info, *args, **kwargs)
        if sampling_info.has_custom_logit_processor or kwargs.get("logprob_logits") is not None:
            raise TrueOnPolicyError("custom logit processors / watermarks are not covered by the exact kernels")
        logits = logits_output.next_token_logits.index_select(0, rows)  # a copy: the sampler overwrites them
        ids = stock(sampler, logits_output, sampling_info, *args, **kwargs)
        out = logits_output.sampling_mask_output
        if out is not None:
            width = out.token_ids.shape[-1]
            listed = torch.arange(width, device=logits.device)[None, :] < out.lengths[:, None].long()
            kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, out.token_ids.long(), listed)
            temperatures = sampling_info.temperatures.index_select(0, rows)
            out.selected_logprobs = K.kept_token_logprobs(logits, kept, ids.index_select(0, rows).long(), temperatures)
        return ids

    return forward


def _exact_split_apply(layer, x, bias, blocks):
    """A row-parallel linear as a tp=``blocks`` learner computes it (``ExactRowParallelLinear``)."""
    if bias is not None:
        raise TrueOnPolicyError("a row-parallel linear's bias with tp blocks is not covered")
    return K.linear(x, layer.weight, tp_blocks=blocks)


def _exact_linear_apply(layer, x, bias=None):
    return K.linear_bias(x, layer.weight, bias)


def _lm_head(hidden_states, lm_head, embedding_bias=None, *, out=None):
    if embedding_bias is not None:
        raise TrueOnPolicyError("an LM head bias is not covered by the exact kernels")
    return K.linear(hidden_states, lm_head.weight, out_dtype=torch.float32)


def _rms_forward(mod, name):
    if getattr(mod, "variance_size_override", None) is not None:
        raise TrueOnPolicyError(f"{name}: RMSNorm with variance_size_override is not covered")

    def forward(x, residual=None, post_residual_addition=None, quant_linear=None, **kwargs):
        if post_residual_addition is not None or kwargs:
            raise TrueOnPolicyError(f"{name}: RMSNorm called with {sorted(kwargs) or ['post_residual_addition']}")
        if residual is None:
            return K.rms_norm(x, mod.weight, mod.variance_epsilon)
        return K.add_rms_norm(x, residual, mod.weight, mod.variance_epsilon)

    return forward


def _rope_forward(mod):
    def forward(positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
        if fused_set_kv_buffer_arg is not None:
            raise TrueOnPolicyError("fused KV-buffer rope is not covered by the exact kernels")
        pos = positions if offsets is None else positions + offsets
        pos = pos.flatten()
        cos, sin = K.rope_cos_sin(pos, mod.rotary_dim, mod.base)
        d = mod.head_size
        q = K.apply_rope(query.reshape(pos.shape[0], -1, d), cos, sin).reshape(query.shape)
        k = K.apply_rope(key.reshape(pos.shape[0], -1, d), cos, sin).reshape(key.shape)
        return q, k

    return forward


def _route_args(block, cfg, name) -> dict:
    """``kernels.router_route``'s arguments for an SGLang MoE block (Qwen3: softmax top-k, renormalised or not;
    GLM-4.5 / DeepSeek-V3 layout: sigmoid, score-correction bias, grouped top-k, routed scaling)."""
    # SGLang's grouped top-k with a correction bias is DeepSeek-V3's biased_grouped_topk: sigmoid scores whatever
    # scoring_func says (GLM-4.5 leaves it at 'softmax')
    score = "sigmoid" if cfg.use_grouped_topk and cfg.correction_bias is not None else cfg.scoring_func
    if score not in ("softmax", "sigmoid") or (score == "sigmoid" and not cfg.renormalize):
        raise TrueOnPolicyError(
            f"{name}: {score} scores with renormalize={cfg.renormalize} are not covered "
            "(Megatron routes with softmax, or sigmoid with normalised top-k weights)"
        )
    if cfg.custom_routing_function is not None or getattr(block, "num_fused_shared_experts", 0):
        raise TrueOnPolicyError(f"{name}: custom routing or shared experts fused into the routed ones are not covered")
    bias = getattr(getattr(block, "gate", None), "e_score_correction_bias", None)
    if cfg.correction_bias is not None and bias is None:
        raise TrueOnPolicyError(f"{name}: a score-correction bias outside the gate is not covered")
    return {
        "score_function": score,
        "pre_softmax": score == "softmax" and not cfg.renormalize,
        "num_groups": cfg.num_expert_group if cfg.use_grouped_topk else None,
        "group_topk": cfg.topk_group if cfg.use_grouped_topk else None,
        "scaling_factor": getattr(block, "routed_scaling_factor", None) or cfg.routed_scaling_factor,
    }


def _moe_forward(block, name, router: bool = True, experts: bool = True):
    """``forward_normal`` of a MoE block: the shared router (``router``) and / or the shared experts and
    combine (``experts``); the other part stays SGLang's own (only ``moe-rl diagnose --attribute`` splits them).
    A block's shared expert (GLM-4.5) runs through the hooked linears and SwiGLU and is added to the routed
    output in the model dtype (Megatron's ``output + shared_expert_output``); the routed scaling is inside
    the routing weights (Megatron's order), not applied to the output."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput, capture_routed_experts_if_allowed  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import

    cfg = block.topk.topk_config
    args = _route_args(block, cfg, name)
    moe = block.experts
    if getattr(moe, "w13_weight_bias", None) is not None or moe.num_local_experts != moe.num_experts:
        raise TrueOnPolicyError(f"{name}: expert biases or expert parallelism inside SGLang are not covered")
    shared = getattr(block, "shared_experts", None)
    if getattr(block, "shared_expert_gate", None) is not None:
        raise TrueOnPolicyError(f"{name}: a gated shared expert is not covered")

    def forward_normal(hidden_states, *_args, **_kwargs):
        if hidden_states.shape[0] == 0:
            return hidden_states
        if router:
            logits = K.router_logits(hidden_states, block.gate.weight)
            bias = getattr(block.gate, "e_score_correction_bias", None)
            weights, ids = K.router_route(logits, cfg.top_k, expert_bias=bias, **args)
            capture_routed_experts_if_allowed(cfg, block.topk.layer_id, ids.to(torch.int32))
            topk = StandardTopKOutput(weights, ids.to(torch.int32), logits)
        else:  # SGLang's gate and top-k (which capture the routes themselves); the scaling applied here
            gate = block.gate(hidden_states)  # Qwen3: (logits, bias); GLM-4.5: logits
            topk = block.topk(hidden_states, gate[0] if isinstance(gate, tuple) else gate)
            weights, ids = topk.topk_weights, topk.topk_ids.long()
            if args["scaling_factor"]:
                weights = weights * args["scaling_factor"]
                topk = StandardTopKOutput(weights, topk.topk_ids, topk.router_logits)
        out = (
            K.moe_experts(hidden_states, weights, ids, moe.w13_weight, moe.w2_weight)
            if experts
            else moe(hidden_states, topk)
        )
        return out if shared is None else out + shared(hidden_states)

    return forward_normal


def _per_request(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, q_lens):
    """``output[start_q:end_q] = attention(...)`` per request; query ``[num_tokens, H, d]``."""
    start_q = 0
    for i in range(seq_lens.shape[0]):
        n, L = int(q_lens[i]), int(seq_lens[i])
        tokens = req_to_token[req_pool_indices[i], :L]
        out = K.attention(query[start_q : start_q + n], k_cache[tokens], v_cache[tokens], start=L - n)
        output[start_q : start_q + n] = out.to(output.dtype)
        start_q += n
    return output


def _sdpa_extend(
    query,
    output,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_prefix_lens,
    extend_seq_lens,
    encoder_lens=None,
    scaling=None,
    enable_gqa=False,
    causal=False,
    is_cross_attn=False,
    sliding_window_size=None,
):
    if encoder_lens is not None or is_cross_attn or not causal or sliding_window_size is not None:
        raise TrueOnPolicyError("only causal self-attention without a sliding window is covered")
    return _per_request(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_seq_lens)


def _sdpa_decode(
    query,
    output,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    encoder_lens=None,
    scaling=None,
    enable_gqa=False,
    causal=False,
    is_cross_attn=False,
    sliding_window_size=None,
):
    if encoder_lens is not None or is_cross_attn or sliding_window_size is not None:
        raise TrueOnPolicyError("only causal self-attention without a sliding window is covered")
    n = seq_lens.shape[0]
    if n == 0:
        return output
    # every request's one query at once (kernels.attention_decode: the same bits as one request at a time)
    tokens = req_to_token[req_pool_indices, : int(seq_lens.max())]
    out = K.attention_decode(query[:n], k_cache[tokens], v_cache[tokens], seq_lens)
    output[:n] = out.to(output.dtype)
    return output
