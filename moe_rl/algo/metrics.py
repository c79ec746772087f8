"""Off-policy diagnostics between two log-prob tensors (usually π_old vs μ).

Owns the dashboard numbers of seed 000, "Identifying mismatch — a diagnostic
toolkit" (verl's compute_offpolicy_metrics + debug probability metrics). It never
changes a gradient or a mask.
"""

from __future__ import annotations

import torch

from moe_rl.algo.tensors import (
    LOG_RATIO_BOUND,
    check_logp,
    check_mask,
    masked_max,
    masked_mean,
    masked_sum,
    metric,
    seq_valid,
)

Metrics = dict[str, torch.Tensor]


def _self_normalised_chi2(log_w: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(χ², ESS) of the weights exp(log_w) at ``valid`` positions, without overflow.

    χ² = mean(w²)/mean(w)² − 1 and ESS = 1/(1 + χ²) = (Σw)²/(N·Σw²).
    Normalising by mean(w)² (instead of assuming the sample mean of ρ is exactly 1)
    makes χ² ≥ 0 by Cauchy–Schwarz and bounds it by N − 1, for any sample.
    The ratio is scale-free, so the weights are shifted by their max before exp
    (every shifted weight is ≤ 1; ones that underflow weigh < 1e-38 of the max).
    """
    n = valid.sum().to(log_w.dtype)
    zero = torch.zeros((), dtype=log_w.dtype, device=log_w.device)
    e = torch.where(valid, torch.exp(log_w - masked_max(log_w, valid)), zero)
    s1, s2 = e.sum(), (e * e).sum()
    one_plus_chi2 = (n * s2 / (s1 * s1)).clamp_min(1)  # ≥ 1 by Cauchy–Schwarz; clamp removes rounding only
    return one_plus_chi2 - 1, 1 / one_plus_chi2


@torch.no_grad()
def offpolicy_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """Mismatch diagnostics from ``old_logp[B, T]`` (π_old), ``rollout_logp[B, T]`` (μ), ``mask[B, T]``.

    With log ρ_t = log π_old − log μ over valid tokens (all keys under ``offpolicy/``):

    - ``kl_k1`` = mean(log μ − log π_old); ``kl_k3`` = mean(ρ − log ρ − 1) — both estimate
      KL(μ‖π_old) from μ's samples; k3 ≥ 0 per token.
    - ``chi2_token`` = mean(ρ²)/mean(ρ)² − 1 ≥ 0 and ``chi2_seq`` the same on sequence
      ratios Π_t ρ_t; ``ess`` / ``ess_seq`` = 1/(1 + χ²) ∈ (0, 1] (normalised ESS).
      ``chi2_token_raw`` / ``chi2_seq_raw`` = mean(ρ²) − 1 as verl logs it (can be < 0
      on a finite sample whose mean ρ is below 1).
    - ``ppl_old`` = exp(−mean log π_old), ``ppl_rollout`` = exp(−mean log μ), over all
      valid tokens; ``ppl_ratio`` = ppl_old / ppl_rollout = exp(kl_k1).
    - ``prob_pearson``: Pearson correlation of the token probabilities (1.0 if both are
      constant and equal, 0.0 if one is constant and they differ);
      ``prob_abs_diff_mean`` / ``prob_abs_diff_max``: |π_old − μ| on token probabilities.
    - ``tv`` = ½ mean|ρ − 1| (total-variation proxy); ``log_ratio_abs_max``.
    """
    mask = check_mask(mask)
    old = check_logp("old_logp", old_logp, mask)
    roll = check_logp("rollout_logp", rollout_logp, mask)
    return offpolicy_metrics_unchecked(old.detach(), roll.detach(), mask)


def offpolicy_metrics_unchecked(old: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """``offpolicy_metrics`` on inputs already validated (``check_mask`` / ``check_logp``) and detached."""
    # float32 is enough: torch sums pairwise, so a mean over 1M tokens keeps ~1e-7 relative error
    n = mask.sum().to(old.dtype)  # counted once: a bool sum is a full pass over [B, T]

    def mean(x: torch.Tensor) -> torch.Tensor:
        return masked_sum(x, mask) / n

    lr = old - roll
    lr_c = lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rho = torch.exp(lr_c)
    valid = seq_valid(mask)
    lr_seq = masked_sum(lr, mask, dim=1)
    lr_seq_c = lr_seq.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    chi2_tok, ess_tok = _self_normalised_chi2(lr, mask)
    chi2_seq, ess_seq = _self_normalised_chi2(lr_seq, valid)
    mean_old, mean_roll = mean(old), mean(roll)
    p_old, p_roll = torch.exp(old), torch.exp(roll)
    diff = (p_old - p_roll).abs()
    a = torch.where(mask, p_old - mean(p_old), torch.zeros((), dtype=old.dtype, device=old.device))
    b = torch.where(mask, p_roll - mean(p_roll), torch.zeros((), dtype=old.dtype, device=old.device))
    denom = torch.sqrt((a * a).sum() * (b * b).sum())
    diff_max = masked_max(diff, mask)
    if bool(denom > 0):
        pearson = (a * b).sum() / denom
    else:  # a constant vector has no correlation; report agreement instead of NaN
        pearson = torch.tensor(1.0 if bool(diff_max == 0) else 0.0, device=old.device)
    return {
        "offpolicy/kl_k1": metric(-mean(lr)),
        "offpolicy/kl_k3": metric(mean(torch.expm1(lr_c) - lr_c)),
        "offpolicy/chi2_token": metric(chi2_tok),
        "offpolicy/chi2_seq": metric(chi2_seq),
        "offpolicy/chi2_token_raw": metric(mean(rho * rho) - 1),
        "offpolicy/chi2_seq_raw": metric(masked_mean(torch.exp(2 * lr_seq_c), valid) - 1),
        "offpolicy/ess": metric(ess_tok),
        "offpolicy/ess_seq": metric(ess_seq),
        "offpolicy/ppl_old": metric(torch.exp(-mean_old)),
        "offpolicy/ppl_rollout": metric(torch.exp(-mean_roll)),
        "offpolicy/ppl_ratio": metric(torch.exp(mean_roll - mean_old)),
        "offpolicy/prob_pearson": metric(pearson),
        "offpolicy/prob_abs_diff_mean": metric(mean(diff)),
        "offpolicy/prob_abs_diff_max": metric(diff_max),
        "offpolicy/tv": metric(0.5 * mean((rho - 1).abs())),
        "offpolicy/log_ratio_abs_max": metric(masked_max(lr.abs(), mask)),
    }
