"""Token-ratio reshaping: MinPRO (minimum prefix ratio), CTPO (cumulative token ratio, √t log clip), ASPO (flipped ratio).

MinPRO and CTPO correct token t by a ratio over its prefix instead of the token ratio alone (seed 000,
"Prefix-level correction"); ASPO keeps the token ratio but weighs positive-advantage tokens by its inverse. Registered by ``loss.type`` like ``moe_rl.algo.losses`` (same
:class:`~moe_rl.algo.registry.LossInputs` contract: per-token term and metrics; the registry applies IS
weights and aggregation). Prefixes run over the tokens of ``x.mask`` only (a rejected or padded
token is not part of any prefix). Formulas and sources: docs/algo.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algo.registry import LossInputs, LossParams, register_policy_loss
from moe_rl.algo.tensors import LOG_RATIO_BOUND, Metrics, check_positive, log_ratio, masked_max, masked_mean, metric

CTPO_LOG_RATIO_CAP = 10.0  # the CTPO reference clamps the cumulative log-ratio at +10 (horizon-llm/CTPO)


@dataclass(frozen=True)
class MinPROParams(LossParams):
    """MinPRO reads no loss-specific key: its trust region is the prefix minimum itself."""


def prefix_min_log_ratio(lr: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log ρ̄[B, T]``: log ρ̄_t = min_{s<t, s in mask} log ρ_s, and 0 (ρ̄ = 1) where the prefix is empty."""
    inf = torch.full((), float("inf"), dtype=lr.dtype, device=lr.device)
    inclusive = torch.where(mask, lr, inf).cummin(dim=1).values
    strict = torch.cat([torch.full_like(inclusive[:, :1], float("inf")), inclusive[:, :-1]], dim=1)
    return torch.where(torch.isinf(strict), torch.zeros_like(strict), strict)


@register_policy_loss("minpro", MinPROParams)
def minpro_loss(x: LossInputs, p: MinPROParams) -> tuple[torch.Tensor, Metrics]:
    """MinPRO: token t's policy gradient weighted by w_t = ρ̄_t · ρ_t, ρ̄_t = min_{s<t} ρ_s (ρ̄_1 = 1).

    Seed 000, "Prefix-level correction" (Lei et al. 2026, arXiv:2601.22718): ρ_s = π_θ/π_anchor
    (``old_logp``; μ in bypass mode). ℓ_t = −A_t · sg[ρ̄_t] · ρ_t, whose gradient is
    −A_t · w_t · ∇log π_θ(y_t): the prefix minimum is a stop-gradient weight (it corrects the
    state distribution of token t; it is not a quantity token t optimises) and there is no clip —
    the seed's table gives MinPRO's trust region as "implicit (prefix-min ratio is bounded)".
    Each log ρ is clamped at ±20. Metrics: prefix_min_mean (ρ̄), weight_mean / weight_max (w),
    approx_kl.
    """
    mask = x.mask
    lr = log_ratio(x.logp, x.old_logp)
    log_bar = prefix_min_log_ratio(lr.detach(), mask)
    w = torch.exp(log_bar + lr)  # value ρ̄·ρ; gradient only through ρ_t
    per_token = -x.advantages * w
    with torch.no_grad():
        metrics: Metrics = {
            "loss/prefix_min_mean": metric(masked_mean(torch.exp(log_bar), mask)),
            "loss/weight_mean": metric(masked_mean(w, mask)),
            "loss/weight_max": metric(masked_max(w, mask).clamp_min(0)),  # weights ≥ 0; empty mask: 0
            "loss/approx_kl": metric(masked_mean(-lr, mask)),
        }
    return per_token, metrics


@dataclass(frozen=True)
class CTPOParams(LossParams):
    """``loss.ctpo_clip_low`` / ``ctpo_clip_high`` / ``ctpo_clip_c``: log-space bases; ``ctpo_clip_power`` p.

    The reference implementation's ``la_clip_low`` / ``la_clip_high`` / ``la_clip_c`` /
    ``clip_ratio_la_power`` (horizon-llm/CTPO, loss ``cum-token-cumprod-la``; defaults 0.025 / 0.05 /
    0.05, and p = 0.5 — the √t schedule the paper and the seed describe for the cumulative ratio).
    """

    ctpo_clip_low: float = 0.025
    ctpo_clip_high: float = 0.05
    ctpo_clip_c: float = 0.05
    ctpo_clip_power: float = 0.5


@register_policy_loss("ctpo", CTPOParams)
def ctpo_loss(x: LossInputs, p: CTPOParams) -> tuple[torch.Tensor, Metrics]:
    """CTPO: PPO clip on the cumulative token ratio ρ_{1:t} = Π_{s≤t} ρ_s with position-scaled log bounds.

    Seed 000 ("Prefix-level correction"; CTPO, Zhang et al. 2026, arXiv:2605.07331) and its reference
    code (horizon-llm/CTPO ``cum-token-cumprod-la``): L_t = Σ_{s≤t} clamp(log ρ_s, ±20) over the
    mask; log r_t = sg[L_t] + log π_θ(y_t) − sg[log π_θ(y_t)], capped at +10 (value L_t, gradient
    through token t only); with τ_t the 1-based position of t among the valid tokens and
    k_t = τ_t^p: r̃_t = exp(clamp(log r_t, −ε_low k_t, ε_high k_t)),
    ℓ_t = max(−A_t r_t, −A_t r̃_t), and for A_t < 0 the dual clip ℓ_t = min(ℓ_t, −A_t exp(c k_t)).
    Metrics: clip_frac, dual_clip_frac, ratio_mean / ratio_max (r_t), approx_kl.
    """
    adv, mask = x.advantages, x.mask
    lo = check_positive("ctpo_clip_low", p.ctpo_clip_low)
    hi = check_positive("ctpo_clip_high", p.ctpo_clip_high)
    c = check_positive("ctpo_clip_c", p.ctpo_clip_c)
    power = float(p.ctpo_clip_power)
    tok = (x.logp - x.old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    cum = torch.where(mask, tok, torch.zeros_like(tok)).cumsum(dim=1).detach()
    log_r = (cum + x.logp - x.logp.detach()).clamp(max=CTPO_LOG_RATIO_CAP)
    ratio = torch.exp(log_r)
    k = mask.to(log_r.dtype).cumsum(dim=1).clamp_min(1.0).pow(power)
    clipped = torch.exp(torch.clamp(log_r, -lo * k, hi * k))
    unclipped_loss, clipped_loss = -adv * ratio, -adv * clipped
    per_token = torch.maximum(unclipped_loss, clipped_loss)
    floor = -adv * torch.exp(c * k)
    dual = (adv < 0) & (per_token > floor)
    per_token = torch.where(dual, floor, per_token)
    n = mask.sum().clamp_min(1)
    with torch.no_grad():
        metrics: Metrics = {
            "loss/clip_frac": metric(((clipped_loss > unclipped_loss) & mask).sum() / n),
            "loss/dual_clip_frac": metric((dual & mask).sum() / n),
            "loss/ratio_mean": metric(masked_mean(ratio, mask)),
            "loss/ratio_max": metric(masked_max(ratio, mask).clamp_min(0)),
            "loss/approx_kl": metric(masked_mean(-tok, mask)),
        }
    return per_token, metrics


@dataclass(frozen=True)
class ASPOParams(LossParams):
    """``loss.clip_low`` ε_low, ``loss.clip_high`` ε_high; ``loss.aspo_dual_clip_c_pos`` / ``aspo_dual_clip_c_neg``.

    The soft dual-clip bounds of A > 0 (on the flipped ratio 1/r) and A < 0 (on r): the reference code's
    ``positive_clip_ratio_c`` / ``negative_clip_ratio_c``, default 3.0 each.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    aspo_dual_clip_c_pos: float = 3.0
    aspo_dual_clip_c_neg: float = 3.0


@register_policy_loss("aspo", ASPOParams)
def aspo_loss(x: LossInputs, p: ASPOParams) -> tuple[torch.Tensor, Metrics]:
    """ASPO (Wang et al. 2025, arXiv:2510.06062): flipped token ratio on A ≥ 0, soft dual clip on both signs.

    Seed 000 ("ASPO ... flips the ratio [for positive-advantage tokens] ... retains standard clipping
    [for negative ones]") and the reference code (zyh1999/ASPO ``compute_policy_loss_archer``, one
    entropy class): r = exp(clamp(log ρ, ±20)).
    A ≥ 0: r̂ = min(r, 1 + ε_high); ℓ = −A·(r̂/sg[r̂])/sg[r̂] (value −A/r̂, gradient −A·(1/r)·∇log π_θ inside
    the clip, 0 above it); where 1/r̂ > c_pos, ℓ = −A·c_pos·log π_θ instead (a stop-gradient weight c_pos:
    the gradient is kept, not zeroed).
    A < 0: r̂ = max(r, 1 − ε_low); ℓ = −A·r̂; where r̂ > c_neg, ℓ = −A·c_neg·log π_θ.
    Metrics: clip_frac_high / clip_frac_low (r above / below its sign's bound), dual_clip_frac_pos /
    dual_clip_frac_neg (soft dual clip active), approx_kl.
    """
    adv, mask = x.advantages, x.mask
    lo = check_positive("clip_low", p.clip_low, upper_exclusive=1.0)
    hi = check_positive("clip_high", p.clip_high)
    c_pos, c_neg = float(p.aspo_dual_clip_c_pos), float(p.aspo_dual_clip_c_neg)
    if not (c_pos > 1.0 and c_neg > 1.0):
        raise ValueError(f"aspo_dual_clip_c_pos / aspo_dual_clip_c_neg: expected > 1, got {c_pos} / {c_neg}")
    lr = log_ratio(x.logp, x.old_logp)
    ratio = torch.exp(lr)
    neg_r = ratio.clamp(min=1.0 - lo)
    pos_r = ratio.clamp(max=1.0 + hi)
    pos_term = -adv * (pos_r / pos_r.detach()) / pos_r.detach()
    pos_dual = (1.0 / pos_r) > c_pos
    pos_term = torch.where(pos_dual, -adv * c_pos * x.logp, pos_term)
    neg_dual = neg_r > c_neg
    neg_term = torch.where(neg_dual, -adv * c_neg * x.logp, -adv * neg_r)
    negative = adv < 0
    per_token = torch.where(negative, neg_term, pos_term)
    n = mask.sum().clamp_min(1)
    with torch.no_grad():
        metrics: Metrics = {
            "loss/clip_frac_high": metric(((ratio > 1.0 + hi) & ~negative & mask).sum() / n),
            "loss/clip_frac_low": metric(((ratio < 1.0 - lo) & negative & mask).sum() / n),
            "loss/dual_clip_frac_pos": metric((pos_dual & ~negative & mask).sum() / n),
            "loss/dual_clip_frac_neg": metric((neg_dual & negative & mask).sum() / n),
            "loss/approx_kl": metric(masked_mean(-lr, mask)),
        }
    return per_token, metrics
