"""Which ``model`` sections each HF format of the HF <-> Megatron bridge can express, and why not.

Owns the capability table of the HF formats moe_rl reads and writes, selected by
``model.hf_architecture``:

* ``Qwen3MoeForCausalLM`` -- softmax router, q/k RMSNorm, full RoPE, no biases, no shared experts;
* ``Glm4MoeForCausalLM`` (GLM-4.5, GQA) -- sigmoid router with score-correction bias (DeepSeek-V3
  routing: group-limited top-k, routed scaling, normalised top-k weights), shared experts,
  first dense layers, q/k/v bias, partial RoPE, optional q/k norm.

``hf_init`` refuses to write what is listed here, the preflight refuses configs whose weights
could not be synced to SGLang, and both say the same thing. Pure Python: no torch, no transformers.
"""

from __future__ import annotations

__all__ = ["unsupported_for_hf"]


def _qwen3_moe(m) -> list[str]:
    out = []
    if m.moe_router_score_function != "softmax":
        out.append(f"model.moe_router_score_function={m.moe_router_score_function!r} (Qwen3-MoE routes with softmax)")
    if m.moe_router_enable_expert_bias:
        out.append("model.moe_router_enable_expert_bias=true (Qwen3-MoE has no score-correction bias)")
    if m.moe_router_num_groups is not None:
        out.append(f"model.moe_router_num_groups={m.moe_router_num_groups} (Qwen3-MoE has no group-limited top-k)")
    if m.moe_router_topk_scaling_factor not in (None, 1.0):
        out.append(
            f"model.moe_router_topk_scaling_factor={m.moe_router_topk_scaling_factor} "
            "(Qwen3-MoE does not scale routing weights)"
        )
    if not m.qk_layernorm:
        out.append("model.qk_layernorm=false (Qwen3 always normalises q/k)")
    if m.moe_shared_expert_intermediate_size is not None:
        out.append("model.moe_shared_expert_intermediate_size (Qwen3-MoE has no shared experts)")
    if m.add_qkv_bias:
        out.append("model.add_qkv_bias=true (Qwen3 has no q/k/v bias)")
    if m.rotary_percent != 1.0:
        out.append(f"model.rotary_percent={m.rotary_percent} (Qwen3 rotates the whole head dim)")
    return out


def _glm4_moe(m) -> list[str]:
    out = []
    if m.moe_router_score_function != "sigmoid" or not m.moe_router_enable_expert_bias:
        out.append(
            f"model.moe_router_score_function={m.moe_router_score_function!r} with "
            f"moe_router_enable_expert_bias={m.moe_router_enable_expert_bias} (GLM-4.5 routes with sigmoid scores "
            "plus a score-correction bias; expected 'sigmoid' and true)"
        )
    if m.moe_router_pre_softmax:
        out.append("model.moe_router_pre_softmax=true (GLM-4.5 normalises the top-k sigmoid weights)")
    groups, group_topk = m.moe_router_num_groups or 1, m.moe_router_group_topk or 1
    if m.moe_router_topk // group_topk != 2 and groups > 1:
        out.append(
            f"model.moe_router_topk={m.moe_router_topk} / moe_router_group_topk={group_topk} must be 2: GLM-4.5 scores "
            "a group by its top-2 experts, Megatron by its top (topk / group_topk)"
        )
    shared = m.moe_shared_expert_intermediate_size
    if shared is None or shared % m.moe_ffn_hidden_size:
        out.append(
            f"model.moe_shared_expert_intermediate_size={shared} must be a multiple of "
            f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} (GLM-4.5 has n_shared_experts >= 1 of that width)"
        )
    if m.moe_layer_pattern() != [0 if i < m.first_k_dense_layers else 1 for i in range(m.num_layers)]:
        out.append(
            f"model.moe_layer_freq={m.moe_layer_freq} (GLM-4.5 has dense layers only first: use first_k_dense_layers)"
        )
    return out


_RULES = {"Qwen3MoeForCausalLM": _qwen3_moe, "Glm4MoeForCausalLM": _glm4_moe}


def unsupported_for_hf(model_cfg) -> list[str]:
    """One ``model.<key>=<value> (<why>)`` entry per setting ``model.hf_architecture`` cannot hold."""
    out = _RULES[model_cfg.hf_architecture](model_cfg)
    if model_cfg.mtp_num_layers:
        out.append(
            f"model.mtp_num_layers={model_cfg.mtp_num_layers} (moe_rl does not convert multi-token-prediction layers)"
        )
    return out
