"""Loss aggregation: how a per-token loss ``loss[B, T]`` becomes one scalar.

Owns the three reductions users pick in ``LossConfig.aggregation``; nothing else.
"""

from __future__ import annotations

import torch

from moe_rl.algo._tensors import masked_sum, seq_valid

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    denominator: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce ``loss[B, T]`` over the bool ``mask[B, T]`` to a scalar.

    - ``token_mean``: Σ_{i,t} m·ℓ / Σ m — every token weighs the same (long answers weigh more).
    - ``seq_mean_token_mean``: mean over sequences with ≥1 valid token of (Σ_t m·ℓ / |y_i|) —
      every sequence weighs the same; the GSPO objective (field-facts item 12).
    - ``seq_mean_token_sum_norm``: Σ_{i,t} m·ℓ / (B · L) with a constant L (``norm_len``,
      default T) — Dr. GRPO's length-unbiased form.

    ``denominator`` replaces the divisor (Σ m, #sequences, or B·L) when the caller must
    normalise by a global count across micro-batches / data-parallel ranks. If the mask
    is all False (everything rejected) the result is a zero that keeps the graph.
    """
    if mode == "token_mean":
        total = masked_sum(loss, mask)
        count = mask.sum().clamp_min(1) if denominator is None else denominator
    elif mode == "seq_mean_token_mean":
        lengths = mask.sum(dim=1)
        per_seq = masked_sum(loss, mask, dim=1) / lengths.clamp_min(1).to(loss.dtype)
        total = per_seq.sum()  # empty rows contribute 0 and are not counted below
        count = seq_valid(mask).sum().clamp_min(1) if denominator is None else denominator
    elif mode == "seq_mean_token_sum_norm":
        total = masked_sum(loss, mask)
        length = mask.shape[1] if norm_len is None else norm_len
        count = mask.shape[0] * length if denominator is None else denominator
    else:
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {mode!r}")
    if isinstance(count, torch.Tensor):
        count = count.to(loss.dtype)
    elif not count > 0:
        raise ValueError(f"aggregation denominator: expected > 0, got {count}")
    return total / count
