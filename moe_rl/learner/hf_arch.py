"""Which ``model`` sections the HF <-> Megatron bridge can express, and why not otherwise.

Owns the capability table of the HF formats moe_rl reads and writes (today: Qwen3-MoE,
``Qwen3MoeForCausalLM``). ``hf_init`` refuses to write what is listed here, the preflight
refuses configs whose weights could not be synced to SGLang, and both say the same thing.
Pure Python: no torch, no transformers.
"""

from __future__ import annotations

__all__ = ["HF_ARCHITECTURE", "unsupported_for_hf"]

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"


def unsupported_for_hf(model_cfg) -> list[str]:
    """One ``model.<key>=<value> (<why>)`` entry per setting the Qwen3-MoE HF format cannot hold."""
    m = model_cfg
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
    if m.mtp_num_layers:
        out.append(f"model.mtp_num_layers={m.mtp_num_layers} (Qwen3-MoE has no multi-token-prediction layers)")
    if not m.qk_layernorm:
        out.append("model.qk_layernorm=false (Qwen3 always normalises q/k)")
    return out
