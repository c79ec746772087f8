"""Trajectory-level off-policy objectives: TOPR (tapered off-policy REINFORCE), OAPL (log-ratio regression), VESPO.

Both read one ratio per response, π_θ(y|x)/π_anchor(y|x) = exp(Σ_t log ρ_t) over the mask, instead of
token ratios. Registered by ``loss.type`` like ``moe_rl.algo.losses`` (per-token term and metrics; the
registry applies IS weights and aggregation). Formulas and sources: docs/algo.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algo.registry import LossInputs, LossParams, register_policy_loss
from moe_rl.algo.tensors import (
    LOG_RATIO_BOUND,
    Metrics,
    check_nonneg,
    check_positive,
    log_ratio,
    masked_mean,
    masked_sum,
    metric,
    seq_valid,
)


@dataclass(frozen=True)
class TOPRParams(LossParams):
    """TOPR reads no loss-specific key: its truncation interval is [0, 1] (paper eq. 8)."""


@register_policy_loss("topr", TOPRParams, aggregation="seq_mean_token_sum")
def topr_loss(x: LossInputs, p: TOPRParams) -> tuple[torch.Tensor, Metrics]:
    """TOPR (Le Roux et al. 2025, arXiv:2503.14286, eq. 8): SFT on positive, truncated IS on negative trajectories.

    ∇J = Σ_{τ: R(τ)≥0} μ(τ) R(τ) ∇log π(τ) + Σ_{τ: R(τ)<0} μ(τ) [π(τ)/μ(τ)]_0^1 R(τ) ∇log π(τ),
    with R(τ) the trajectory's advantage Ā_i (masked mean of ``advantages`` over its tokens) and
    π(τ)/μ(τ) = exp(Σ_t m_t (log π_θ − log π_anchor)) (log clamped at ±20). Per token:
    ℓ_t = −sg[w_i] · A_t · log π_θ(y_t), w_i = 1 if Ā_i ≥ 0 else min(1, π(τ)/μ(τ)); the default
    aggregation seq_mean_token_sum gives ∇log π(τ) = Σ_t ∇log π_θ(y_t) and the mean over trajectories.
    Metrics: neg_frac (trajectories with Ā < 0), neg_weight_mean (their w), approx_kl.
    """
    mask = x.mask
    with torch.no_grad():
        log_seq = masked_sum(x.logp - x.old_logp, mask, dim=1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        adv_seq = masked_mean(x.advantages, mask, dim=1)
        negative = adv_seq < 0
        w = torch.where(negative, torch.exp(log_seq).clamp(max=1.0), torch.ones_like(log_seq))
        valid = seq_valid(mask)
        neg = negative & valid
        metrics: Metrics = {
            "loss/neg_frac": metric(neg.sum() / valid.sum().clamp_min(1)),
            "loss/neg_weight_mean": metric(w[neg].mean() if bool(neg.any()) else 1.0),
            "loss/approx_kl": metric(masked_mean(x.old_logp - x.logp, mask)),
        }
    return -w[:, None] * x.advantages * x.logp, metrics


@dataclass(frozen=True)
class OAPLParams(LossParams):
    """``loss.oapl_beta`` β, the scale of the log-ratio regressed on the advantage (the KL coefficient)."""

    oapl_beta: float = 1.0


@register_policy_loss("oapl", OAPLParams, aggregation="seq_mean_token_mean")
def oapl_loss(x: LossInputs, p: OAPLParams) -> tuple[torch.Tensor, Metrics]:
    """OAPL (Ritter et al. 2026, arXiv:2602.19362; seed 000, "Optimal off-policy objectives"): least squares.

    min_π Σ_x Σ_i (β ln π(y_i|x)/π_inf(y_i|x) − (r(x, y_i) − V̂*(x)))², with π_inf the rollout
    policy — so ``old_logp`` must be μ (``correction.mode: bypass``; the config refuses OAPL in
    decoupled mode) — and r − V̂* the advantage of ``advantage.estimator`` (its masked mean Ā_i over the
    response). ln π(y|x)/π_inf(y|x) = Σ_t m_t clamp(log π_θ − log μ, ±20). The squared error of
    response i is put on each of its tokens; the default aggregation seq_mean_token_mean is the mean
    over responses. Metrics: residual_mean / residual_abs_mean (β·log-ratio − Ā), seq_log_ratio_mean.
    """
    beta = check_positive("oapl_beta", p.oapl_beta)
    mask = x.mask
    seq_lr = masked_sum(log_ratio(x.logp, x.old_logp), mask, dim=1)
    adv_seq = masked_mean(x.advantages, mask, dim=1)
    residual = beta * seq_lr - adv_seq
    per_token = (residual * residual)[:, None].expand_as(mask)
    valid = seq_valid(mask)
    with torch.no_grad():
        r = residual.detach()[valid]
        metrics: Metrics = {
            "loss/residual_mean": metric(r.mean() if r.numel() else 0.0),
            "loss/residual_abs_mean": metric(r.abs().mean() if r.numel() else 0.0),
            "loss/seq_log_ratio_mean": metric(seq_lr.detach()[valid].mean() if r.numel() else 0.0),
        }
    return per_token, metrics


@dataclass(frozen=True)
class VESPOParams(LossParams):
    """``loss.vespo_k_pos`` / ``vespo_lambda_pos`` (k, λ for Ā ≥ 0), ``vespo_k_neg`` / ``vespo_lambda_neg`` (Ā < 0).

    Defaults are the authors' (FloyedShen/VESPO ``recipe/vespo``: 2.0 / 3.0 / 3.0 / 2.0).
    """

    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@register_policy_loss("vespo", VESPOParams, folds_is_weights=True)
def vespo_loss(x: LossInputs, p: VESPOParams) -> tuple[torch.Tensor, Metrics]:
    """VESPO (Shen et al. 2026, arXiv:2602.10693): REINFORCE weighted by a gamma kernel of the sequence IS ratio.

    The authors' code (FloyedShen/VESPO ``compute_policy_loss_vespo``): log W_i = clamp(Σ_t m_t
    (clamp(log ρ_t, ±20) + clamp(log w_t, ±20)), ±20) with ``is_weights`` w_t folded in (so they are not
    multiplied into the loss again: the sequence ratio is then to μ); φ(W) = exp(λ + k·log W − λ·W), i.e.
    W^k e^{−λW} normalised to φ(1) = 1, with (k, λ) chosen by the sign of Ā_i (≥ 0: pos), λ ≥ 1e-4,
    log W ≥ log 1e-8, non-finite φ → 0; ℓ_t = −sg[φ_i]·A_t·log π_θ(y_t). Metrics: phi_mean / phi_max,
    seq_log_ratio_mean.
    """
    mask = x.mask
    for name in ("vespo_k_pos", "vespo_k_neg"):
        check_nonneg(name, getattr(p, name))
    for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
        check_positive(name, getattr(p, name))
    with torch.no_grad():
        lr = log_ratio(x.logp, x.old_logp)
        if x.is_weights is not None:
            lr = lr + torch.log(x.is_weights.clamp_min(1e-8)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        log_w = masked_sum(lr, mask, dim=1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        w = torch.exp(log_w)
        pos = masked_mean(x.advantages, mask, dim=1) >= 0
        k = torch.where(pos, torch.full_like(w, p.vespo_k_pos), torch.full_like(w, p.vespo_k_neg))
        lam = torch.where(pos, torch.full_like(w, p.vespo_lambda_pos), torch.full_like(w, p.vespo_lambda_neg))
        lam = lam.clamp_min(1e-4)
        phi = torch.exp(lam + k * torch.log(w.clamp_min(1e-8)) - lam * w)
        phi = torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)
        valid = seq_valid(mask)
        ph = phi[valid]
        metrics: Metrics = {
            "loss/phi_mean": metric(ph.mean() if ph.numel() else 0.0),
            "loss/phi_max": metric(ph.max() if ph.numel() else 0.0),
            "loss/seq_log_ratio_mean": metric(log_w[valid].mean() if ph.numel() else 0.0),
        }
    return -phi[:, None] * x.advantages * x.logp, metrics
