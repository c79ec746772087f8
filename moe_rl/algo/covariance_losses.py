"""Covariance-selected token losses: Clip-Cov and KL-Cov (Cui et al. 2025, arXiv:2505.22617).

Both score every valid token by the centred product cov_t = (A_t − Ā)(log π_θ(y_t) − mean log π_θ)
and treat the high-covariance tokens specially: Clip-Cov zeroes a random sample of them in
the PPO-clip loss, KL-Cov adds β|log r_t| to the top fraction. Same contract as
``moe_rl.algo.losses``. The centring means and the selection count couple all tokens of a
minibatch, so a caller splitting it into microbatches passes the minibatch's ``center``
(Ā, mean log π_θ) and ``num_select`` (see :func:`cov_selection_count`).
"""

from __future__ import annotations

import torch

from moe_rl.algo._tensors import check_positive, log_ratio, masked_mean, metric
from moe_rl.algo.losses import Metrics, _clip_bounds, _finish, _inputs


def token_covariance(
    logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, center: tuple[float, float] | None = None
) -> torch.Tensor:
    """cov[B, T] = (A − Ā)(log π_θ − mean log π_θ), detached; −inf outside ``mask``.

    ``center = (Ā, mean log π_θ)`` over the whole minibatch; None = over this ``mask``.
    """
    with torch.no_grad():
        lp = logp.detach()
        a_mean, lp_mean = (masked_mean(adv, mask), masked_mean(lp, mask)) if center is None else center
        cov = (adv - a_mean) * (lp - lp_mean)
        return torch.where(mask, cov, torch.full_like(cov, float("-inf")))


def cov_selection_count(num_tokens: int, fraction: float) -> int:
    """max(1, ⌊fraction · num_tokens⌋) — verl's count of tokens Clip-Cov / KL-Cov act on."""
    return max(int(fraction * int(num_tokens)), 1)


def clip_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    cov_fraction: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    center: tuple[float, float] | None = None,
    num_select: int | None = None,
    is_weights: torch.Tensor | None = None,
    aggregation: str = "token_mean",
    loss_denominator: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov: PPO-clip with the gradient (and loss) of a random few high-covariance tokens removed.

    Candidates: valid tokens not already clipped by PPO with cov_lb < cov_t < cov_ub; of them
    ``num_select`` (default max(1, ⌊cov_fraction·N⌋)) are drawn uniformly without replacement
    using ``generator`` (seed it from (train.seed, step, minibatch, rank) so resume is exact)
    and get ℓ_t = 0. Metrics: cov_clip_frac (tokens zeroed), clip_frac (PPO), approx_kl.
    """
    logp, old_logp, adv, mask, is_weights = _inputs(logp, old_logp, advantages, mask, is_weights)
    lo, hi = _clip_bounds(clip_low, clip_high)
    check_positive("clip_cov_ratio", cov_fraction)
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(lo, hi)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clip_active = (clipped > unclipped) & mask
        cov = token_covariance(logp, adv, mask, center)
        candidates = (cov > cov_lb) & (cov < cov_ub) & mask & ~clip_active
        idx = candidates.reshape(-1).nonzero().squeeze(1)
        k = cov_selection_count(int(mask.sum()), cov_fraction) if num_select is None else int(num_select)
        perm = torch.randperm(idx.numel(), generator=generator, device="cpu").to(idx.device)
        chosen = idx[perm[: min(k, idx.numel())]]
        drop = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        drop[chosen] = True
        drop = drop.view_as(mask)
        n = mask.sum().clamp_min(1)
        metrics: Metrics = {
            "loss/cov_clip_frac": metric(drop.sum() / n),
            "loss/clip_frac": metric(clip_active.sum() / n),
            "loss/approx_kl": metric(masked_mean(-lr, mask)),
        }
    per_token = torch.where(drop, torch.zeros_like(per_token), per_token)
    return _finish(per_token, mask, is_weights, aggregation, loss_denominator, metrics)


def kl_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cov_fraction: float = 2e-4,
    kl_coef: float = 1.0,
    center: tuple[float, float] | None = None,
    num_select: int | None = None,
    is_weights: torch.Tensor | None = None,
    aggregation: str = "token_mean",
    loss_denominator: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov: ℓ_t = −A_t r_t, plus β·|log r_t| on the top-k tokens by cov_t (k = max(1, ⌊fraction·N⌋)).

    No ratio clipping: the |log r| penalty on the highest-covariance tokens is the only
    constraint (verl ``kl_cov``, ``ppo_kl_coef`` = β). Ties at the k-th value are broken by
    position (``torch.topk``). Metrics: cov_kl_frac, kl_abs_mean (mean |log r|), approx_kl.
    """
    logp, old_logp, adv, mask, is_weights = _inputs(logp, old_logp, advantages, mask, is_weights)
    check_positive("kl_cov_ratio", cov_fraction)
    if not kl_coef >= 0:
        raise ValueError(f"kl_cov_coef: expected ≥ 0, got {kl_coef}")
    lr = log_ratio(logp, old_logp)
    per_token = -adv * torch.exp(lr)
    with torch.no_grad():
        cov = token_covariance(logp, adv, mask, center).reshape(-1)
        k = cov_selection_count(int(mask.sum()), cov_fraction) if num_select is None else int(num_select)
        k = min(k, int(mask.sum()))
        top = torch.topk(cov, k).indices
        pick = torch.zeros_like(cov, dtype=torch.bool)
        pick[top] = True
        pick = pick.view_as(mask) & mask
        n = mask.sum().clamp_min(1)
        metrics: Metrics = {
            "loss/cov_kl_frac": metric(pick.sum() / n),
            "loss/kl_abs_mean": metric(masked_mean(lr.abs(), mask)),
            "loss/approx_kl": metric(masked_mean(-lr, mask)),
        }
    per_token = per_token + torch.where(pick, kl_coef * lr.abs(), torch.zeros_like(lr))
    return _finish(per_token, mask, is_weights, aggregation, loss_denominator, metrics)
