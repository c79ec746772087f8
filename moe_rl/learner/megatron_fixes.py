"""Fixes for Megatron-Core 0.16.1 bugs that moe_rl's configs reach (CPU and GPU alike).

Owns idempotent, narrowly scoped patches applied before a model is built:

* ``TopKRouter._apply_expert_bias`` with a ``padding_mask``: ``routing()`` flattens the mask to
  ``[num_tokens]`` and then ANDs it with ``routing_map[num_tokens, E]``, which broadcasts over the
  expert dim and fails (or, when ``num_tokens == E``, silently masks experts). The fix gives the
  mask its trailing dim, ``[num_tokens, 1]``, so padding tokens do not count towards the load that
  updates the score-correction bias (sigmoid routers with ``moe_router_enable_expert_bias``).
"""

from __future__ import annotations

__all__ = ["apply_megatron_fixes"]


def apply_megatron_fixes() -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    original = TopKRouter._apply_expert_bias
    if getattr(original, "_moe_rl_fixed", False):
        return

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if padding_mask is not None and padding_mask.dim() == routing_map.dim() - 1:
            padding_mask = padding_mask.unsqueeze(-1)
        return original(self, routing_map, padding_mask=padding_mask)

    _apply_expert_bias._moe_rl_fixed = True
    TopKRouter._apply_expert_bias = _apply_expert_bias
