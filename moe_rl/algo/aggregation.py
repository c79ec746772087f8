"""Loss aggregation: how a per-token loss ``loss[B, T]`` becomes one scalar.

Owns the five reductions users pick in ``LossConfig.aggregation`` and the divisor each
implies; nothing else.
"""

from __future__ import annotations

import torch

from moe_rl.algo.tensors import masked_sum, seq_valid

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum", "seq_mean_token_sum")


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
      default T, the padded length) — Dr. GRPO's length-unbiased form. Set ``norm_len`` (the
      config's ``loss.norm_len``) so L does not change with the padding of each batch.
    - ``token_sum``: Σ_{i,t} m·ℓ, no normaliser (verl ``token-sum``).
    - ``seq_mean_token_sum``: mean over sequences with ≥1 valid token of Σ_t m·ℓ (verl
      ``seq-mean-token-sum``): each sequence weighs its length.

    ``denominator`` replaces the divisor (Σ m, #sequences, B·L; 1 for ``token_sum``) when the
    caller must normalise by a global count across micro-batches / data-parallel ranks. If
    the mask is all False (everything rejected) the result is a zero that keeps the graph.
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
        count = default_denominator(mask, mode, norm_len) if denominator is None else denominator
    elif mode == "token_sum":
        total = masked_sum(loss, mask)
        count = 1.0 if denominator is None else denominator
    elif mode == "seq_mean_token_sum":
        total = masked_sum(loss, mask)
        count = seq_valid(mask).sum().clamp_min(1) if denominator is None else denominator
    else:
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {mode!r}")
    if isinstance(count, torch.Tensor):
        count = count.to(loss.dtype)
    elif not count > 0:
        raise ValueError(f"aggregation denominator: expected > 0, got {count}")
    return total / count


def default_denominator(mask: torch.Tensor, mode: str, norm_len: int | None = None) -> float | torch.Tensor:
    """The divisor ``aggregate`` uses for ``mask[B, T]`` when no global one is given.

    A caller that splits a minibatch into microbatches sums these per-microbatch counts
    (or, for ``seq_mean_token_sum_norm``, uses B_total · ``norm_len``) and passes the sum
    as ``denominator`` to every microbatch, so the loss does not depend on the split.
    """
    if mode == "token_mean":
        return mask.sum().clamp_min(1)
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
        return seq_valid(mask).sum().clamp_min(1)
    if mode == "seq_mean_token_sum_norm":
        if norm_len is not None and not (isinstance(norm_len, int) and norm_len >= 1):
            raise ValueError(f"loss.norm_len: expected an integer ≥ 1 (a fixed length normaliser), got {norm_len!r}")
        return float(mask.shape[0] * (mask.shape[1] if norm_len is None else norm_len))
    if mode == "token_sum":
        return 1.0
    raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {mode!r}")
