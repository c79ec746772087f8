"""Fixes for Megatron-Core bugs on paths moe_rl takes (any device), each guarded and idempotent.

Owns version-guarded replacements of single Megatron methods; each states the bug and the
condition under which it applies, and has a test showing the failure it prevents
(tests/learner/test_expert_bias.py). It must not change behaviour where Megatron is correct.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["apply_megatron_fixes"]


def _expert_bias_counts_valid_tokens(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """``TopKRouter._apply_expert_bias`` with the pad mask broadcast over experts.

    megatron-core 0.16.1 computes ``routing_map[N, E] & ~padding_mask[N]``, which cannot broadcast
    (a RuntimeError as soon as a padding mask reaches a router with ``moe_router_enable_expert_bias``);
    the intent — count only non-pad tokens per expert — needs ``padding_mask[:, None]``.
    """
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1).bool()
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def _needs_expert_bias_fix(router_cls) -> bool:
    method = router_cls._apply_expert_bias
    if method is _expert_bias_counts_valid_tokens:
        return False
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    return "routing_map & (~padding_mask)" in source


def apply_megatron_fixes() -> list[str]:
    """Apply the fixes this Megatron version needs; returns their names (idempotent)."""
    from megatron.core.transformer.moe.router import TopKRouter

    applied = []
    if _needs_expert_bias_fix(TopKRouter):
        TopKRouter._apply_expert_bias = _expert_bias_counts_valid_tokens
        applied.append("TopKRouter._apply_expert_bias: pad mask broadcast over experts")
    return applied
