"""Per-token importance weights that correct the engine mismatch π_old / μ.

Owns IcePop (band-masked ratio, token or sequence level) and truncated IS (token / sequence), plus the
IS-weight health statistics. Every weight returned here is detached: it is a
change of measure, never something to differentiate (seed 003, "Implementation
in verl: The Three-Policy Framework"; seed 001, "Correction Approach 2: Truncated
Importance Sampling (TIS)").
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from moe_rl.algo.tensors import (
    LOG_RATIO_BOUND,
    check_logp,
    check_mask,
    check_nonneg,
    check_positive,
    log_ratio,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    metric,
    seq_valid,
)

Metrics = dict[str, torch.Tensor]


def weight_stats(prefix: str, w: torch.Tensor, valid: torch.Tensor) -> Metrics:
    """Health statistics of the weights ``w`` at the True positions of ``valid`` (same shape).

    ``ess`` is the normalised effective sample size (Σw)² / (N·Σw²) ∈ (0, 1]
    (seed 000, "IS weight health and rejection sampling metrics"); it is 1 when
    all weights are equal and → 1/N when one weight dominates.
    """
    w = w.detach()
    n = valid.sum().clamp_min(1).to(w.dtype)
    mean = masked_sum(w, valid) / n
    sq = masked_sum(w * w, valid) / n
    ess = torch.where(sq > 0, mean * mean / sq, torch.zeros((), dtype=w.dtype, device=w.device))
    return {
        f"{prefix}/weight_mean": metric(mean),
        f"{prefix}/weight_std": metric((sq - mean * mean).clamp_min(0).sqrt()),
        f"{prefix}/weight_min": metric(masked_min(w, valid)),
        f"{prefix}/weight_max": metric(masked_max(w, valid)),
        f"{prefix}/ess": metric(ess),
    }


def _check_band(old_logp, rollout_logp, mask, low, high):
    mask = check_mask(mask)
    old_logp = check_logp("old_logp", old_logp, mask)
    rollout_logp = check_logp("rollout_logp", rollout_logp, mask)
    low = check_nonneg("icepop low", low)
    high = check_positive("icepop high", high)
    if not high > low:
        raise ValueError(f"icepop band: expected low < high, got low={low}, high={high}")
    return old_logp, rollout_logp, mask, low, high


@torch.no_grad()
def icepop_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    low: float = 0.5,
    high: float = 5.0,
    weighted: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """IcePop token weights ``w[B, T]`` from ``old_logp[B, T]``, ``rollout_logp[B, T]``, ``mask[B, T]``.

    With k_t = π_old(y_t) / μ(y_t) (training vs inference engine, same weights):
    ``weighted=True``  → w_t = k_t · 1[low ≤ k_t ≤ high]   (Ring-1T §2.3.2 / slime / verl);
    ``weighted=False`` → w_t = 1[low ≤ k_t ≤ high]          (plain two-sided mask).
    Seed 000, section "MoE-specific alignment" (IcePop); seed 004, "IcePop: Token-Level
    Two-Sided Masking in MoE". Default band [0.5, 5.0] is Ring-1T's (field-facts item 11).

    Out-of-band tokens get weight 0 but stay in the mask: the Ring-1T objective keeps
    them in the 1/Σ|y| normaliser. Padding gets weight 0. Returns detached weights and
    ``icepop/masked_frac`` (+ low/high split) over valid tokens.
    """
    old_logp, rollout_logp, mask, low, high = _check_band(old_logp, rollout_logp, mask, low, high)
    return _icepop_weights(old_logp, rollout_logp, mask, low, high, weighted)


@torch.no_grad()
def _icepop_weights(old_logp, rollout_logp, mask, low, high, weighted):
    k = torch.exp(log_ratio(old_logp, rollout_logp))
    below = (k < low) & mask
    above = (k > high) & mask
    keep = mask & ~below & ~above
    zero, one = torch.zeros((), dtype=k.dtype, device=k.device), torch.ones((), dtype=k.dtype, device=k.device)
    w = torch.where(keep, k if weighted else one, zero)
    n = mask.sum()
    n_below, n_above = below.sum(), above.sum()
    return w, {
        "icepop/masked_frac": metric((n_below + n_above) / n),
        "icepop/masked_frac_low": metric(n_below / n),
        "icepop/masked_frac_high": metric(n_above / n),
    }


@torch.no_grad()
def sequence_icepop_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    low: float = 0.5,
    high: float = 5.0,
    weighted: bool = True,
    geometric: bool = False,
) -> tuple[torch.Tensor, Metrics]:
    """Sequence-level IcePop weights ``w[B, T]``: one band test per sequence, broadcast to its tokens.

    log K_i = Σ_t m·(log π_old − log μ) (``geometric=False``: the sequence ratio K_i = Π_t ρ_t,
    verl's sequence-level band) or (1/|y_i|) Σ_t m·(log π_old − log μ) (``geometric=True``: the
    geometric-mean ratio, length-invariant). The band low ≤ K_i ≤ high is tested in log space,
    so no product is exponentiated; ``weighted=True`` gives w = min(K_i, e²⁰)·1[band], else
    1[band]. Sources: seed 004, "IcePop" (two-sided masking) applied at sequence level as in
    seed 003's sequence-level rejection. Out-of-band sequences stay in the mask with weight 0.
    Metrics: ``icepop/seq_masked_frac`` (+ low/high split) and ``icepop/masked_frac`` (tokens).
    """
    old_logp, rollout_logp, mask, low, high = _check_band(old_logp, rollout_logp, mask, low, high)
    valid = seq_valid(mask)
    lr = old_logp - rollout_logp
    log_k = masked_mean(lr, mask, dim=1) if geometric else masked_sum(lr, mask, dim=1)
    below = (log_k < (math.log(low) if low > 0 else float("-inf"))) & valid
    above = (log_k > math.log(high)) & valid
    keep = valid & ~below & ~above
    k = torch.exp(log_k.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    w_seq = torch.where(keep, k if weighted else torch.ones_like(k), torch.zeros_like(k))
    w = torch.where(mask, w_seq[:, None], torch.zeros((), dtype=k.dtype, device=k.device))
    n_seq = valid.sum()
    return w, {
        "icepop/seq_masked_frac": metric((below.sum() + above.sum()) / n_seq),
        "icepop/seq_masked_frac_low": metric(below.sum() / n_seq),
        "icepop/seq_masked_frac_high": metric(above.sum() / n_seq),
        "icepop/masked_frac": metric((mask & ~keep[:, None]).sum() / mask.sum()),
    }


@torch.no_grad()
def truncated_is_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    level: Literal["token", "sequence"] = "token",
    threshold: float = 2.0,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, Metrics]:
    """Truncated IS weights ``w[B, T]`` from ``old_logp[B, T]``, ``rollout_logp[B, T]``, ``mask[B, T]``.

    ρ_t = π_old(y_t) / μ(y_t), computed in log space.
    ``level="token"``:    w_t = min(ρ_t, C).
    ``level="sequence"``: w_i = min(Π_t ρ_t, C), broadcast to every valid token of sequence i.
    ``batch_normalize``: divide by the batch mean of the truncated weights, over valid
    tokens (token level) or over sequences with ≥1 valid token (sequence level), so the
    batch mean is exactly 1 (seed 003, §3.6 batch normalisation; seed 000, "Importance
    sampling correction"). Truncation happens first, so a normalised weight can exceed C.

    Returns detached weights (0 on padding) and ``is/*`` metrics: weight stats, ESS,
    ``is/truncated_frac`` (fraction of tokens or sequences with ρ > C) and
    ``is/batch_norm_factor`` (the mean divided out; 1 when not normalising).
    """
    mask = check_mask(mask)
    old_logp = check_logp("old_logp", old_logp, mask)
    rollout_logp = check_logp("rollout_logp", rollout_logp, mask)
    threshold = check_positive("is threshold", threshold)
    if level not in ("token", "sequence"):
        raise ValueError(f"is level: expected 'token' or 'sequence', got {level!r}")
    return _truncated_is_weights(old_logp, rollout_logp, mask, level, threshold, batch_normalize)


@torch.no_grad()
def _truncated_is_weights(old_logp, rollout_logp, mask, level, threshold, batch_normalize):
    zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)
    if level == "token":
        log_rho = log_ratio(old_logp, rollout_logp)
        w = torch.where(mask, torch.exp(log_rho).clamp(max=threshold), zero)
        trunc_frac = ((log_rho > math.log(threshold)) & mask).sum() / mask.sum()
        norm = masked_mean(w, mask) if batch_normalize else torch.ones((), dtype=w.dtype, device=w.device)
        w = w / norm
        stats = weight_stats("is", w, mask)
    else:
        # Sum the unclamped token log-ratios, then bound the *sequence* log-ratio: the
        # product of ratios is the quantity that overflows (seed 000, "The length trap").
        valid = seq_valid(mask)
        log_rho_seq = masked_sum(old_logp - rollout_logp, mask, dim=1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        trunc_frac = ((log_rho_seq > math.log(threshold)) & valid).sum() / valid.sum()
        w_seq = torch.exp(log_rho_seq).clamp(max=threshold)
        norm = masked_mean(w_seq, valid) if batch_normalize else torch.ones((), dtype=w_seq.dtype, device=w_seq.device)
        w_seq = w_seq / norm
        w = torch.where(mask, w_seq[:, None], zero)
        stats = weight_stats("is", w_seq, valid)
    stats["is/truncated_frac"] = metric(trunc_frac)
    stats["is/batch_norm_factor"] = metric(norm)
    return w, stats
