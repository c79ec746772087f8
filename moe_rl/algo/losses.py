"""Policy-gradient surrogate losses on ``[B, T]`` log-probs: PPO-clip, GSPO, GSPO-token, CISPO, REINFORCE, GPG.

Each is registered by its ``loss.type`` (``moe_rl.algo.registry``): a function of the validated
:class:`~moe_rl.algo.registry.LossInputs` and its hyper-parameter model, returning the per-token
term and metrics; calling the registered loss multiplies the IS weights and aggregates, giving
``(scalar loss to minimise, metrics)``. Ratios are formed in log space and clamped to ±20 before exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algo.registry import LossInputs, LossParams, register_policy_loss
from moe_rl.algo.tensors import (
    LOG_RATIO_BOUND,
    Metrics,
    check_nonneg,
    log_ratio,
    masked_max,
    masked_mean,
    metric,
    seq_valid,
)


def clip_bounds(clip_low: float, clip_high: float) -> tuple[float, float]:
    """(1 − ε_low, 1 + ε_high) after checking ε_low ∈ [0, 1) and ε_high ≥ 0."""
    lo = check_nonneg("clip_low", clip_low)
    hi = check_nonneg("clip_high", clip_high)
    if lo >= 1.0:
        raise ValueError(f"clip_low: expected ε_low in [0, 1) so that 1 − ε_low > 0, got {clip_low}")
    return 1.0 - lo, 1.0 + hi


def sequence_log_ratio(
    x: torch.Tensor, mask: torch.Tensor, is_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log s[B], inside[B]): log s_i = masked mean of ``x[B, T]`` (a token log-ratio), clamped at ±20.

    Beyond ±20 the gradient is zero (``inside`` = 0 there, as a clamp's is). The ±20 is our bound;
    verl clamps its token-form log-ratio at +10 only (docs/algo.md). With detached
    ``is_weights[B, T]`` the value is unchanged but the gradient reaching token t is weighted
    by w_t / w̄_i (w̄_i the sequence's mean weight), so that after the weights multiply the
    sequence's tokens each token's gradient carries its own weight — as in GSPO-token.
    """
    raw = masked_mean(x, mask, dim=1)
    inside = ((raw >= -LOG_RATIO_BOUND) & (raw <= LOG_RATIO_BOUND)).to(x.dtype)
    log_s = raw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if is_weights is None:
        return log_s, inside
    w_bar = masked_mean(is_weights, mask, dim=1)
    u = masked_mean(is_weights * x, mask, dim=1)
    scale = torch.where(w_bar > 0, 1 / w_bar.clamp_min(torch.finfo(w_bar.dtype).tiny), torch.zeros_like(w_bar))
    return log_s.detach() + (u - u.detach()) * scale * inside, inside


@dataclass(frozen=True)
class PPOClipParams(LossParams):
    """``loss.clip_low`` ε_low, ``loss.clip_high`` ε_high, ``loss.dual_clip_c`` c (None = no dual clip)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = None


@register_policy_loss("ppo_clip", PPOClipParams)
def ppo_clip_loss(x: LossInputs, p: PPOClipParams) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate with asymmetric range and optional dual clip.

    r_t = π_θ / π_old;  ℓ_t = max(−A_t r_t, −A_t clip(r_t, 1−ε_low, 1+ε_high))
    and, with dual clip c > 1, for A_t < 0: ℓ_t = min(ℓ_t, −c·A_t) (seed 000,
    "Vanilla PPO clip": verl's clip_ratio_c floor on negative-advantage tokens).
    Metrics: clip_frac (tokens where the clipped branch is active), clip_frac_low /
    clip_frac_high (which side), dual_clip_frac, ratio_mean/max, approx_kl (mean log π_old − log π_θ).
    """
    adv, mask = x.advantages, x.mask
    lo, hi = clip_bounds(p.clip_low, p.clip_high)
    if p.dual_clip_c is not None and not float(p.dual_clip_c) > 1.0:
        raise ValueError(f"dual_clip_c: expected > 1 (a floor at c·|A| for A < 0), got {p.dual_clip_c}")
    lr = log_ratio(x.logp, x.old_logp)
    ratio = torch.exp(lr)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(lo, hi)
    per_token = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped) & mask
    metrics: Metrics = {
        "loss/clip_frac": metric(clip_active.sum() / mask.sum().clamp_min(1)),
        "loss/clip_frac_low": metric((clip_active & (ratio < lo)).sum() / mask.sum().clamp_min(1)),
        "loss/clip_frac_high": metric((clip_active & (ratio > hi)).sum() / mask.sum().clamp_min(1)),
    }
    if p.dual_clip_c is not None:
        floor = -adv * float(p.dual_clip_c)
        dual_active = (adv < 0) & (per_token > floor)
        per_token = torch.where(dual_active, floor, per_token)
        metrics["loss/dual_clip_frac"] = metric((dual_active & mask).sum() / mask.sum().clamp_min(1))
    with torch.no_grad():
        metrics["loss/ratio_mean"] = metric(masked_mean(ratio, mask))
        metrics["loss/ratio_max"] = metric(masked_max(ratio, mask).clamp_min(0))  # ratios ≥ 0; empty mask: 0
        metrics["loss/approx_kl"] = metric(masked_mean(-lr, mask))
    return per_token, metrics


@dataclass(frozen=True)
class GSPOParams(LossParams):
    """``loss.clip_low`` / ``loss.clip_high`` on the sequence ratio (GSPO paper: 3e-4 / 4e-4)."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4


def _gspo(x: LossInputs, p: GSPOParams, token_level: bool) -> tuple[torch.Tensor, Metrics]:
    logp, old_logp, adv, mask = x.logp, x.old_logp, x.advantages, x.mask
    lo, hi = clip_bounds(p.clip_low, p.clip_high)
    log_s, inside = sequence_log_ratio(logp - old_logp, mask, None if token_level else x.is_weights)  # [B]
    if token_level:
        log_s_tok = log_s.detach()[:, None] + (logp - logp.detach()) * inside[:, None]
        s = torch.exp(log_s_tok)  # [B, T]; value s_i, d/dlogp_t = s_i
        unclipped, clipped = -adv * s, -adv * s.clamp(lo, hi)
        per_token = torch.maximum(unclipped, clipped)
        clip_active = (clipped > unclipped) & mask
    else:
        s = torch.exp(log_s)  # [B]
        adv_seq = masked_mean(adv, mask, dim=1)
        unclipped, clipped = -adv_seq * s, -adv_seq * s.clamp(lo, hi)
        per_seq = torch.maximum(unclipped, clipped)
        per_token = per_seq[:, None].expand_as(mask)
        clip_active = (clipped > unclipped)[:, None] & mask
    valid = seq_valid(mask)
    with torch.no_grad():
        s_seq = torch.exp(log_s.detach())[valid]
        metrics: Metrics = {
            "loss/clip_frac": metric(clip_active.sum() / mask.sum().clamp_min(1)),
            "loss/seq_ratio_mean": metric(s_seq.mean() if s_seq.numel() else 1.0),
            "loss/seq_ratio_min": metric(s_seq.min() if s_seq.numel() else 1.0),
            "loss/seq_ratio_max": metric(s_seq.max() if s_seq.numel() else 1.0),
            "loss/approx_kl": metric(masked_mean(old_logp - logp, mask)),
        }
    return per_token, metrics


@register_policy_loss("gspo", GSPOParams, aggregation="seq_mean_token_mean")
def gspo_loss(x: LossInputs, p: GSPOParams) -> tuple[torch.Tensor, Metrics]:
    """GSPO: PPO clipping on the geometric-mean sequence ratio.

    s_i = exp((1/|y_i|) Σ_t m·(log π_θ − log π_old)), the mean over *valid* tokens only
    (seed 000, "GSPO — geometric sequence ratios"; field-facts item 12).
    ℓ_i = max(−A_i s_i, −A_i clip(s_i, 1−ε_low, 1+ε_high)) with the ordinary gradient through
    log s_i; A_i is the masked mean of ``advantages`` over the sequence; ℓ_i is broadcast to the
    sequence's tokens before aggregation. With A constant per sequence it gives the same loss and
    gradient as :func:`gspo_token_loss`, also with token IS weights (each token's gradient is
    weighted by its own w_t in both forms) and beyond |mean log-ratio| > 20 (log s_i clamped at ±20,
    zero gradient outside); see ``sequence_log_ratio``. Metrics: clip_frac (tokens in clipped
    sequences), seq_ratio_*, approx_kl.
    """
    return _gspo(x, p, token_level=False)


@register_policy_loss("gspo_token", GSPOParams, aggregation="seq_mean_token_mean")
def gspo_token_loss(x: LossInputs, p: GSPOParams) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token: s_{i,t} = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)], with per-token A_{i,t}.

    Equal to s_i (:func:`gspo_loss`) in value, gradient only through the token's own log-prob
    (GSPO paper §4.3); ℓ_t = max(−A_t s_{i,t}, −A_t clip(s_{i,t}, 1−ε_low, 1+ε_high)).
    """
    return _gspo(x, p, token_level=True)


@dataclass(frozen=True)
class CISPOParams(LossParams):
    """``loss.cispo_clip_low`` (None = no lower bound), ``loss.cispo_clip_high`` (None = ``clip_high``)."""

    cispo_clip_low: float | None = None
    cispo_clip_high: float | None = None
    clip_high: float = 0.2


@register_policy_loss("cispo", CISPOParams)
def cispo_loss(x: LossInputs, p: CISPOParams) -> tuple[torch.Tensor, Metrics]:
    """CISPO: ℓ_t = −sg[clip(r_t, 1−ε_low, 1+ε_high)] · A_t · log π_θ(y_t).

    The clipped ratio is a stop-gradient weight, so every token keeps a gradient
    (seed 000, "CISPO — stop-gradient clipping"; seed 001 table). ``cispo_clip_low=None``
    means no lower bound (MiniMax-M1 only truncates from above); ε_high is ``cispo_clip_high``,
    or ``clip_high`` when that is None.
    Metrics: clip_frac (tokens whose ratio was changed by the clip), ratio_mean/max.
    """
    logp, old_logp, mask = x.logp, x.old_logp, x.mask
    clip_high = p.clip_high if p.cispo_clip_high is None else p.cispo_clip_high
    lo = 0.0 if p.cispo_clip_low is None else clip_bounds(p.cispo_clip_low, clip_high)[0]
    hi = 1.0 + check_nonneg("clip_high", clip_high)
    with torch.no_grad():
        ratio = torch.exp(log_ratio(logp, old_logp))
        weight = ratio.clamp(lo, hi)
        metrics: Metrics = {
            "loss/clip_frac": metric(((weight != ratio) & mask).sum() / mask.sum().clamp_min(1)),
            "loss/ratio_mean": metric(masked_mean(ratio, mask)),
            "loss/ratio_max": metric(masked_max(ratio, mask).clamp_min(0)),  # ratios ≥ 0; empty mask: 0
            "loss/approx_kl": metric(masked_mean(old_logp - logp, mask)),
        }
    return -weight * x.advantages * logp, metrics


@dataclass(frozen=True)
class ReinforceParams(LossParams):
    """REINFORCE reads no loss-specific key."""


@register_policy_loss("reinforce", ReinforceParams, anchored=False)
def reinforce_loss(x: LossInputs, p: ReinforceParams) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE: ℓ_t = −w_t · A_t · log π_θ(y_t) with detached IS weights w_t (1 if None).

    Off-policy REINFORCE with truncated IS (seed 003, "Theoretical Foundation: From
    REINFORCE to Decoupled PPO"; seed 002 TIS form;
    seed 000, "Bypass mode loss": for REINFORCE the IS weights are applied explicitly).
    ``x.old_logp`` is not read.
    """
    return -x.advantages * x.logp, {}


@dataclass(frozen=True)
class GPGParams(LossParams):
    """GPG reads no loss-specific key."""


@register_policy_loss("gpg", GPGParams, anchored=False)
def gpg_loss(x: LossInputs, p: GPGParams) -> tuple[torch.Tensor, Metrics]:
    """GPG (verl ``register_policy_loss("gpg")``): ℓ_t = −w_t · A_t · log π_θ(y_t), no ratio, no clip.

    verl 0.9.1 ``compute_policy_loss_gpg``: ``pg_losses = -log_prob * advantages``, times
    ``rollout_is_weights`` when given, then ``agg_loss`` (GPG, Chu et al. 2025, arXiv:2504.02546: the
    plain policy gradient with the group-baseline advantage of ``advantage.estimator: gpg``). The same
    per-token term as ``reinforce``; its own name so a verl config's ``loss_mode: gpg`` ports by name.
    ``x.old_logp`` is not read.
    """
    return -x.advantages * x.logp, {}
