"""Surrogates that reshape or bound the trust region differently from PPO's hard clip: SAPO, GMPO, DPPO.

Registered by ``loss.type`` like ``moe_rl.algo.losses`` (same :class:`~moe_rl.algo.registry.LossInputs`
contract; each function returns the per-token term and metrics, the registry applies IS weights and
aggregation). Formulas and sources: docs/algo.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algo.losses import sequence_log_ratio
from moe_rl.algo.registry import LossInputs, LossParams, register_policy_loss
from moe_rl.algo.tensors import Metrics, check_nonneg, check_positive, log_ratio, masked_mean, metric

DPPO_DIVERGENCES = ("tv", "kl")


@dataclass(frozen=True)
class SAPOParams(LossParams):
    """``loss.sapo_tau_pos`` τ for A > 0, ``loss.sapo_tau_neg`` τ for A ≤ 0."""

    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05


@register_policy_loss("sapo", SAPOParams, aggregation="seq_mean_token_mean")
def sapo_loss(x: LossInputs, p: SAPOParams) -> tuple[torch.Tensor, Metrics]:
    """SAPO soft gate: ℓ_t = −A_t · (4/τ) · σ(τ (r_t − 1)), τ = τ_pos if A_t > 0 else τ_neg.

    r_t = π_θ/π_old (log space, ±20). The gradient weight on ∇log π_θ is
    4 r σ(τ(r−1))(1 − σ(τ(r−1))), equal to r_t·1 at r = 1 and decaying smoothly on both sides
    (Gao et al. 2025, arXiv:2511.20347; seed 000, "SAPO — smooth objective shaping").
    Metrics: gate_weight_mean (mean of 4σ(1−σ), the factor replacing PPO's 0/1 clip), approx_kl.
    """
    adv, mask = x.advantages, x.mask
    tp, tn = check_positive("sapo_tau_pos", p.sapo_tau_pos), check_positive("sapo_tau_neg", p.sapo_tau_neg)
    lr = log_ratio(x.logp, x.old_logp)
    tau = torch.where(adv > 0, torch.full_like(adv, tp), torch.full_like(adv, tn))
    sig = torch.sigmoid(tau * (torch.exp(lr) - 1))
    per_token = -adv * sig * (4 / tau)
    with torch.no_grad():
        metrics: Metrics = {
            "loss/gate_weight_mean": metric(masked_mean(4 * sig * (1 - sig), mask)),
            "loss/approx_kl": metric(masked_mean(-lr, mask)),
        }
    return per_token, metrics


@dataclass(frozen=True)
class GMPOParams(LossParams):
    """``loss.clip_low`` / ``loss.clip_high``: log-space bounds ε_low / ε_high (paper: 0.4)."""

    clip_low: float = 0.4
    clip_high: float = 0.4


@register_policy_loss("gmpo", GMPOParams, aggregation="seq_mean_token_mean")
def gmpo_loss(x: LossInputs, p: GMPOParams) -> tuple[torch.Tensor, Metrics]:
    """GMPO: PPO on the geometric mean of sign-aware clipped token ratios, per sequence.

    x_t = log π_θ − log π_old; x̃_t = sgn(A_i)·min(sgn(A_i)·x_t, sgn(A_i)·clamp(x_t, −ε_low, ε_high));
    ℓ_i = −A_i · exp(mean_t x̃_t), broadcast to the sequence's tokens (Zhao et al. 2025,
    arXiv:2507.20673; verl ``geo_mean``). ε are log-space bounds (paper: 0.4). A_i is the
    masked mean of ``advantages``. Metrics: clip_frac_high / clip_frac_low (tokens whose
    log-ratio was clamped, A > 0 / A < 0), seq_ratio_mean, approx_kl.
    """
    mask = x.mask
    lo, hi = check_nonneg("clip_low", p.clip_low), check_nonneg("clip_high", p.clip_high)
    adv_seq = masked_mean(x.advantages, mask, dim=1)
    sgn = torch.sign(adv_seq)[:, None]
    lr = x.logp - x.old_logp
    lr_clamped = lr.clamp(-lo, hi)
    lr_min = sgn * torch.minimum(sgn * lr, sgn * lr_clamped)
    log_s, _ = sequence_log_ratio(lr_min, mask, x.is_weights)
    per_seq = -adv_seq * torch.exp(log_s)
    per_token = per_seq[:, None].expand_as(mask)
    with torch.no_grad():
        clamped = (lr != lr_clamped) & mask
        n = mask.sum().clamp_min(1)
        metrics: Metrics = {
            "loss/clip_frac_high": metric((clamped & (sgn > 0)).sum() / n),
            "loss/clip_frac_low": metric((clamped & (sgn < 0)).sum() / n),
            "loss/seq_ratio_mean": metric(masked_mean(torch.exp(log_s.detach()), mask.any(dim=1))),
            "loss/approx_kl": metric(masked_mean(-lr, mask)),
        }
    return per_token, metrics


def dppo_trust_mask(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, divergence: str, delta_low: float, delta_high: float
) -> torch.Tensor:
    """DPPO's keep mask ``[B, T]`` (detached): tokens whose update stays inside the divergence bound.

    TV: p − p_old ≤ δ_high when A > 0, p − p_old ≥ −δ_low otherwise (p = π_θ(y_t), p_old = π_old(y_t)).
    KL: binary KL D = p_old log(p_old/p) + (1−p_old) log((1−p_old+1e-8)/(1−p+1e-8)); keep when
    D ≤ δ_high or p ≤ p_old (A > 0), D ≤ δ_low or p ≥ p_old (A ≤ 0) — only moves that
    increase the divergence in the advantage's direction are masked.
    """
    with torch.no_grad():
        p, p_old = torch.exp(logp.detach()), torch.exp(old_logp)
        if divergence == "tv":
            up, down = (p - p_old) <= delta_high, (p - p_old) >= -delta_low
        elif divergence == "kl":
            d = p_old * (old_logp - logp.detach()) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            up, down = (d <= delta_high) | (p <= p_old), (d <= delta_low) | (p >= p_old)
        else:
            raise ValueError(f"dppo divergence: expected one of {DPPO_DIVERGENCES}, got {divergence!r}")
        return torch.where(adv > 0, up, down)


@dataclass(frozen=True)
class DPPOParams(LossParams):
    """``loss.clip_low`` δ_low (A ≤ 0), ``loss.clip_high`` δ_high (A > 0), ``loss.dppo_ratio_cap`` C.

    The divergence bounds reuse the clip keys, as verl reuses its clip ratios.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    dppo_ratio_cap: float = 20.0


def _dppo(x: LossInputs, p: DPPOParams, divergence: str) -> tuple[torch.Tensor, Metrics]:
    logp, old_logp, adv, mask = x.logp, x.old_logp, x.advantages, x.mask
    lo, hi = check_nonneg("clip_low", p.clip_low), check_nonneg("clip_high", p.clip_high)
    cap = check_positive("dppo_ratio_cap", p.dppo_ratio_cap)
    trust = dppo_trust_mask(logp, old_logp, adv, divergence, lo, hi)
    with torch.no_grad():
        lr = log_ratio(logp, old_logp)
        ratio = torch.exp(lr)
        weight = ratio.clamp(max=cap) * trust.to(ratio.dtype)
        n = mask.sum().clamp_min(1)
        metrics: Metrics = {
            "loss/clip_frac": metric((~trust & mask).sum() / n),
            "loss/ratio_capped_frac": metric(((ratio > cap) & trust & mask).sum() / n),
            "loss/approx_kl": metric(masked_mean(-lr, mask)),
        }
    return -adv * weight * logp, metrics


@register_policy_loss("dppo_tv", DPPOParams)
def dppo_tv_loss(x: LossInputs, p: DPPOParams) -> tuple[torch.Tensor, Metrics]:
    """DPPO-TV: ℓ_t = −A_t · sg[min(r_t, C)] · log π_θ(y_t) · 1[trust(t)], trust bounding p − p_old.

    The trust mask (:func:`dppo_trust_mask`) bounds the per-token binary TV divergence between π_θ
    and π_old instead of the ratio; the truncated ratio min(r, C) (C = 20) is a stop-gradient
    weight (Qi et al. 2026, arXiv:2602.04879; seed 000, "DPPO-TV / DPPO-KL").
    Metrics: clip_frac (masked tokens), ratio_capped_frac, approx_kl.
    """
    return _dppo(x, p, "tv")


@register_policy_loss("dppo_kl", DPPOParams)
def dppo_kl_loss(x: LossInputs, p: DPPOParams) -> tuple[torch.Tensor, Metrics]:
    """DPPO-KL: as :func:`dppo_tv_loss` with the per-token binary KL divergence in the trust mask."""
    return _dppo(x, p, "kl")
