"""Rejection masks: drop tokens or whole sequences whose policies disagree too much.

Owns the 11 verl rejection-sampling modes (k1/k2/k3 × token / seq_sum / seq_mean /
seq_max), the token veto and DeepSeek-V3.2 off-policy sequence masking (OPSM).
Every function returns a *keep* mask ``keep[B, T]`` (bool) that is a subset of the
input mask — rejection only ever removes tokens — plus its metrics.
"""

from __future__ import annotations

import math
from typing import get_args

import torch

from moe_rl.algo.tensors import (
    LOG_RATIO_BOUND,
    check_logp,
    check_mask,
    check_nonneg,
    check_positive,
    check_seq_or_token,
    masked_max,
    masked_mean,
    masked_sum,
    metric,
    seq_valid,
)
from moe_rl.config.algo_sections import RejectionMode

Metrics = dict[str, torch.Tensor]

RS_MODES = get_args(RejectionMode)  # the config's list of correction.rs_mode values, in its order


def token_divergence(log_rho: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token divergence ``d[B, T]`` from ``log_rho[B, T]`` = log π_old − log μ.

    k1: log ρ (compared against ratio bounds by the caller);
    k2: ½ (log ρ)²;  k3: ρ − log ρ − 1, written as expm1(x) − x so that it is ≥ 0 up to
    rounding even for |x| ≪ 1 (seed 000, "Rejection sampling correction").
    """
    if estimator == "k1":
        return log_rho
    if estimator == "k2":
        return 0.5 * log_rho * log_rho
    if estimator == "k3":
        x = log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.expm1(x) - x
    raise ValueError(f"divergence estimator: expected 'k1', 'k2' or 'k3', got {estimator!r}")


def _rs_bounds(mode: str, lower: float | None, upper: float | None) -> tuple[float | None, float]:
    if upper is None:
        raise ValueError(f"rs_upper: rejection mode {mode!r} needs an upper threshold, got None")
    upper = check_positive("rs_upper", upper)
    if mode.endswith("k1"):
        # k1 bounds are ratio bounds; verl's default lower bound is the reciprocal.
        lower = 1.0 / upper if lower is None else check_nonneg("rs_lower", lower)
        if not lower <= upper:
            raise ValueError(f"rs_lower/rs_upper: expected lower ≤ upper for {mode!r}, got {lower} > {upper}")
        return lower, upper
    if lower is not None:
        raise ValueError(f"rs_lower: mode {mode!r} takes only an upper divergence threshold, got rs_lower={lower}")
    return None, upper


@torch.no_grad()
def rejection_mask(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    lower: float | None = None,
    upper: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Rejection-sampling keep mask ``keep[B, T]`` from ``old_logp[B, T]``, ``rollout_logp[B, T]``, ``mask[B, T]``.

    ``mode = <aggregation>_<estimator>`` (seed 000, "Rejection sampling correction";
    seed 003, "Algorithmic Components and Combinations"):

    - k1 uses ratio bounds ``[lower, upper]`` (lower defaults to 1/upper):
      token_k1 keeps tokens with ρ_t in bounds; seq_sum_k1 keeps sequences with
      Π_t ρ_t in bounds; seq_mean_k1 keeps sequences whose geometric-mean ratio
      exp(mean_t log ρ_t) is in bounds (length-invariant: the length-trap fix).
    - k2 / k3 use an upper threshold on d_t (½(log ρ)² or ρ − log ρ − 1): token_*
      rejects tokens with d_t > upper; seq_sum / seq_mean / seq_max reject the whole
      sequence when Σ_t d_t / mean_t d_t / max_t d_t exceeds upper.

    Comparisons for k1 happen in log space, so no ratio is ever exponentiated.
    Metrics: ``rs/masked_frac`` (valid tokens removed), ``rs/seq_masked_frac``
    (sequences that lost ≥1 token), ``rs/stat_mean`` / ``rs/stat_max`` (the
    aggregated statistic: log-ratio for k1, divergence for k2/k3).
    """
    if mode not in RS_MODES:
        raise ValueError(f"rs_mode: expected one of {RS_MODES}, got {mode!r}")
    mask = check_mask(mask)
    old_logp = check_logp("old_logp", old_logp, mask)
    rollout_logp = check_logp("rollout_logp", rollout_logp, mask)
    lower, upper = _rs_bounds(mode, lower, upper)
    return _rejection_mask(old_logp, rollout_logp, mask, mode, lower, upper)


@torch.no_grad()
def _rejection_mask(old_logp, rollout_logp, mask, mode, lower, upper):
    agg, estimator = mode.rsplit("_", 1)
    d = token_divergence(old_logp - rollout_logp, estimator)
    valid = seq_valid(mask)
    if agg == "token":
        stat, stat_mask = d, mask
    elif agg == "seq_sum":
        stat, stat_mask = masked_sum(d, mask, dim=1), valid
    elif agg == "seq_mean":
        stat, stat_mask = masked_mean(d, mask, dim=1), valid
    else:  # seq_max
        stat, stat_mask = masked_max(d, mask, dim=1), valid
    if estimator == "k1":
        log_lower = math.log(lower) if lower > 0 else float("-inf")  # lower = 0: no lower bound
        reject = (stat < log_lower) | (stat > math.log(upper))
    else:
        reject = stat > upper
    reject = reject & stat_mask
    keep = mask & ~reject if agg == "token" else mask & ~reject[:, None]
    n_tok = mask.sum()
    n_removed = n_tok - keep.sum()
    seq_removed = (keep.sum(dim=1) < mask.sum(dim=1)).sum()
    return keep, {
        "rs/masked_frac": metric(n_removed / n_tok),
        "rs/seq_masked_frac": metric(seq_removed / valid.sum()),
        "rs/stat_mean": metric(masked_mean(stat, stat_mask)),
        "rs/stat_max": metric(masked_max(stat, stat_mask)),
    }


@torch.no_grad()
def token_veto(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> tuple[torch.Tensor, Metrics]:
    """Veto keep mask ``keep[B, T]``: drop a sequence if any valid token has ρ_t < threshold.

    ρ_t = π_old(y_t) / μ(y_t) on the *unclamped* log ratio (a catastrophic token must
    not be rescued by the ±20 safety bound). Seed 003, "Safety Mechanisms: Veto for
    catastrophic outliers"; seed 004, "Worst Token Reject Sampling" (typical thresholds 1e-4 … 1e-6).
    Metrics: ``veto/seq_masked_frac``, ``veto/token_frac`` (catastrophic tokens).
    """
    mask = check_mask(mask)
    old_logp = check_logp("old_logp", old_logp, mask)
    rollout_logp = check_logp("rollout_logp", rollout_logp, mask)
    threshold = check_positive("token_veto_threshold", threshold)
    return _token_veto(old_logp, rollout_logp, mask, threshold)


@torch.no_grad()
def _token_veto(old_logp, rollout_logp, mask, threshold):
    catastrophic = ((old_logp - rollout_logp) < math.log(threshold)) & mask
    vetoed = catastrophic.any(dim=1)
    keep = mask & ~vetoed[:, None]
    return keep, {
        "veto/seq_masked_frac": metric(vetoed.sum() / seq_valid(mask).sum()),
        "veto/token_frac": metric(catastrophic.sum() / mask.sum()),
    }


@torch.no_grad()
def opsm_mask(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    delta: float,
) -> tuple[torch.Tensor, Metrics]:
    """DeepSeek-V3.2 off-policy sequence mask ``keep[B, T]``.

    Inputs: ``logp[B, T]`` (current π_θ, or π_old), ``rollout_logp[B, T]`` (μ, the
    inference engine's log-probs), ``mask[B, T]``, ``advantages[B]`` or ``[B, T]``
    (a token tensor is reduced to its per-sequence masked mean).
    Drops sequence i iff A_i < 0 and (1/|y_i|) Σ_t (log μ(y_t) − log π(y_t)) > delta.
    Using μ from the inference engine makes one gate catch both engine mismatch and
    minibatch staleness (seed 000, "Asynchronous training lag" and "Industrial
    adoption: DeepSeek-V3.2's stack"). ``logp`` is read detached.
    Metrics: ``opsm/seq_masked_frac``, ``opsm/token_masked_frac``, ``opsm/kl_mean``.
    """
    mask = check_mask(mask)
    logp = check_logp("logp", logp.detach(), mask)
    rollout_logp = check_logp("rollout_logp", rollout_logp, mask)
    adv = check_seq_or_token("advantages", advantages.detach(), mask)
    delta = float(delta)
    if not math.isfinite(delta):
        raise ValueError(f"opsm_delta: expected a finite threshold, got {delta}")
    return _opsm_mask(logp, rollout_logp, mask, adv, delta)


@torch.no_grad()
def _opsm_mask(logp, rollout_logp, mask, adv, delta):
    valid = seq_valid(mask)
    kl_seq = masked_mean(rollout_logp - logp, mask, dim=1)
    adv_seq = masked_mean(adv, mask, dim=1)
    drop = (adv_seq < 0) & (kl_seq > delta) & valid
    keep = mask & ~drop[:, None]
    n_seq = valid.sum()
    return keep, {
        "opsm/seq_masked_frac": metric(drop.sum() / n_seq),
        "opsm/token_masked_frac": metric((mask.sum(dim=1) * drop).sum() / mask.sum()),
        "opsm/kl_mean": metric(masked_mean(kl_seq, valid)),
    }


def _criterion_fields(criterion) -> tuple[str, float | None, float | None]:
    """(mode, lower, upper) from a dict or an object with those attributes (config ``RejectionCriterion``)."""
    get = criterion.get if isinstance(criterion, dict) else lambda k, d=None: getattr(criterion, k, d)
    mode = get("mode")
    if mode is None:
        raise ValueError(f"correction.rejection: each criterion needs a 'mode' (one of {RS_MODES}), got {criterion!r}")
    return mode, get("lower", None), get("upper", None)


@torch.no_grad()
def chained_rejection_mask(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, criteria
) -> tuple[torch.Tensor, Metrics]:
    """AND of several rejection criteria, each ``{mode, lower, upper}`` as in :func:`rejection_mask`.

    Every criterion is evaluated on the *input* mask (so each reports what it alone rejects)
    and the keep masks are AND-ed; verl's comma-separated ``rollout_rs`` does the same.
    Metrics: per criterion ``rs/<i>_<mode>/masked_frac`` and ``.../seq_masked_frac``, plus the
    combined ``rs/masked_frac`` and ``rs/seq_masked_frac``.
    """
    mask = check_mask(mask)
    old_logp = check_logp("old_logp", old_logp, mask)
    rollout_logp = check_logp("rollout_logp", rollout_logp, mask)
    if not criteria:
        raise ValueError("correction.rejection: expected a non-empty list of {mode, lower, upper} criteria")
    keep, metrics = mask, {}
    for i, criterion in enumerate(criteria):
        mode, lower, upper = _criterion_fields(criterion)
        if mode not in RS_MODES:
            raise ValueError(f"correction.rejection[{i}].mode: expected one of {RS_MODES}, got {mode!r}")
        lower, upper = _rs_bounds(mode, lower, upper)
        k, m = _rejection_mask(old_logp, rollout_logp, mask, mode, lower, upper)
        keep = keep & k
        metrics[f"rs/{i}_{mode}/masked_frac"] = m["rs/masked_frac"]
        metrics[f"rs/{i}_{mode}/seq_masked_frac"] = m["rs/seq_masked_frac"]
    n_tok = mask.sum()
    metrics["rs/masked_frac"] = metric((n_tok - keep.sum()) / n_tok)
    metrics["rs/seq_masked_frac"] = metric((keep.sum(dim=1) < mask.sum(dim=1)).sum() / seq_valid(mask).sum())
    return keep, metrics


TRM_ESTIMATORS = ("k2", "k3")


@torch.no_grad()
def trm_mask(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, delta: float, estimator: str = "k3"
) -> tuple[torch.Tensor, Metrics]:
    """Trust Region Masking (TRM): admit a sequence only if max_t D_KL(c_t) ≤ δ, else mask all its tokens.

    Li et al. 2025, arXiv:2512.23075 (seed 000, "Sequence-validity screening"): the per-token KL
    D_KL(c_t) is estimated on the sampled token from log ρ_t = log π_old − log μ with ``estimator``
    k2 (½(log ρ)²) or k3 (ρ − log ρ − 1) — verl's ``seq_max_k2`` / ``seq_max_k3`` rejection, which the
    TRM authors contributed (verl PR #4544). Same keep mask as ``rejection_mask(mode='seq_max_<est>',
    upper=δ)``. Metrics: ``trm/seq_masked_frac``, ``trm/masked_frac``, ``trm/max_kl_mean``, ``trm/max_kl_max``.
    """
    if estimator not in TRM_ESTIMATORS:
        raise ValueError(f"trm_estimator: expected one of {TRM_ESTIMATORS}, got {estimator!r}")
    delta = check_positive("trm_delta", delta)
    mask = check_mask(mask, allow_empty=True)
    if not bool(mask.any()):  # nothing to admit: an empty keep mask and zero metrics, no error
        zero = metric(0.0)
        return mask, {
            "trm/seq_masked_frac": zero,
            "trm/masked_frac": zero,
            "trm/max_kl_mean": zero,
            "trm/max_kl_max": zero,
        }
    keep, m = rejection_mask(old_logp, rollout_logp, mask, f"seq_max_{estimator}", None, delta)
    return keep, {
        "trm/seq_masked_frac": m["rs/seq_masked_frac"],
        "trm/masked_frac": m["rs/masked_frac"],
        "trm/max_kl_mean": m["rs/stat_mean"],
        "trm/max_kl_max": m["rs/stat_max"],
    }
