"""Covariance-selected token losses: Clip-Cov and KL-Cov (Cui et al. 2025, arXiv:2505.22617).

Both score every valid token by the centred product cov_t = (A_t − Ā)(log π_θ(y_t) − mean log π_θ)
and treat the high-covariance tokens specially: Clip-Cov zeroes a random sample of them in
the PPO-clip loss, KL-Cov adds β|log r_t| to the top fraction. Same contract as
``moe_rl.algo.losses``. The centring means and the selection count couple all tokens of a
minibatch, so the trainer computes the selection once per minibatch with
:func:`cov_selection` (phase 1, on the no-grad pre-pass π_θ, which equals the step's π_θ) and
passes the rows of each microbatch as ``selected``; without it each call selects on what it sees.
"""

from __future__ import annotations

import torch

from moe_rl.algo.tensors import check_positive, log_ratio, masked_mean, metric
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


def _kl_cov_top(logp, adv, mask, k, center):
    """Flat indices of KL-Cov's top-k tokens by covariance, computed as verl's ``compute_policy_loss_kl_cov``.

    The valid tokens in row-major order, centred by their own means (or ``center``), ``torch.topk``
    on the CPU: equal covariances (e.g. one sequence in the minibatch, so A − Ā = 0 everywhere)
    are then broken exactly as verl breaks them — an order torch leaves unspecified, which changes
    with the token count, so only the same computation on the same values reproduces it.
    """
    idx = mask.reshape(-1).nonzero().squeeze(1)
    a = adv.detach().reshape(-1)[idx].cpu()
    lp = logp.detach().reshape(-1)[idx].cpu()
    a_mean, lp_mean = (a.mean(), lp.mean()) if center is None else (float(center[0]), float(center[1]))
    cov = (a - a_mean) * (lp - lp_mean)
    return idx[torch.topk(cov, min(k, cov.numel())).indices.to(idx.device)]


@torch.no_grad()
def _select(kind, logp, old_logp, adv, mask, clip_low, clip_high, fraction, lb, ub, generator, center, num_select):
    """The ``[B, T]`` tokens Clip-Cov zeroes (``kind="clip"``) or KL-Cov penalises (``kind="kl"``)."""
    k = cov_selection_count(int(mask.sum()), fraction) if num_select is None else int(num_select)
    picked = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if kind == "kl":
        picked[_kl_cov_top(logp, adv, mask, k, center)] = True
        return picked.view_as(mask)
    cov = token_covariance(logp, adv, mask, center)
    lo, hi = _clip_bounds(clip_low, clip_high)
    ratio = torch.exp(log_ratio(logp.detach(), old_logp))
    clip_active = (-adv * ratio.clamp(lo, hi) > -adv * ratio) & mask
    candidates = (cov > lb) & (cov < ub) & mask & ~clip_active
    idx = candidates.reshape(-1).nonzero().squeeze(1)
    perm = torch.randperm(idx.numel(), generator=generator, device="cpu").to(idx.device)
    picked[idx[perm[: min(k, idx.numel())]]] = True
    return picked.view_as(mask)


@torch.no_grad()
def cov_selection(loss_cfg, logp, old_logp, advantages, mask, generator=None) -> torch.Tensor | None:
    """Phase-1 selection ``selected[N, T]`` over a whole minibatch for ``loss.type`` clip_cov / kl_cov (else None).

    ``logp[N, T]`` is π_θ (no-grad pre-pass), ``old_logp`` the loss's anchor, ``advantages``
    ``[N]`` or ``[N, T]``, ``mask[N, T]`` the tokens entering the loss; ``generator`` seeds
    Clip-Cov's draw: seed it from (train.seed, step, epoch, minibatch) and *not* the rank — every
    rank sees the same gathered rows and must draw the same tokens (``train/update.py``). The
    centring means and the count k are the minibatch's, so the selection does not depend on the
    microbatch split (verl selects per microbatch: docs/algo.md "Porting a verl config").
    """
    t = loss_cfg.type
    if t not in ("clip_cov", "kl_cov"):
        return None
    from moe_rl.algo.tensors import check_logp, check_mask, check_seq_or_token

    mask = check_mask(mask, allow_empty=True)
    if not bool(mask.any()):
        return torch.zeros_like(mask)
    logp = check_logp("logp", logp.detach(), mask)
    old_logp = check_logp("old_logp", old_logp.detach(), mask)
    adv = check_seq_or_token("advantages", advantages.detach(), mask)
    opt = lambda name, default: getattr(loss_cfg, name, default)  # noqa: E731
    if t == "kl_cov":
        return _select("kl", logp, old_logp, adv, mask, 0.0, 0.0, opt("kl_cov_ratio", 2e-4), 0.0, 0.0, None, None, None)
    return _select("clip", logp, old_logp, adv, mask, loss_cfg.clip_low, loss_cfg.clip_high,
                   opt("clip_cov_ratio", 2e-4), opt("clip_cov_lb", 1.0), opt("clip_cov_ub", 5.0), generator,
                   None, None)  # fmt: skip


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
    selected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov: PPO-clip with the gradient (and loss) of a random few high-covariance tokens removed.

    Candidates: valid tokens not already clipped by PPO with cov_lb < cov_t < cov_ub; of them
    ``num_select`` (default max(1, ⌊cov_fraction·N⌋)) are drawn uniformly without replacement
    using ``generator`` (seed it from (train.seed, step, epoch, minibatch) — the same on every rank —
    so resume is exact)
    and get ℓ_t = 0. ``selected[B, T]`` (from :func:`cov_selection`) replaces the draw.
    Metrics: cov_clip_frac (tokens zeroed), clip_frac (PPO), approx_kl.
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
        if selected is None:
            drop = _select("clip", logp, old_logp, adv, mask, clip_low, clip_high, cov_fraction, cov_lb, cov_ub,
                           generator, center, num_select)  # fmt: skip
        else:
            drop = selected.bool() & mask
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
    kl_coef: float = 0.1,
    center: tuple[float, float] | None = None,
    num_select: int | None = None,
    is_weights: torch.Tensor | None = None,
    aggregation: str = "token_mean",
    loss_denominator: float | None = None,
    selected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov: ℓ_t = −A_t r_t, plus β·|log r_t| on the top-k tokens by cov_t (k = max(1, ⌊fraction·N⌋)).

    No ratio clipping: the |log r| penalty on the highest-covariance tokens is the only
    constraint (verl ``kl_cov``, ``ppo_kl_coef`` = β). Ties at the k-th value are broken as verl
    breaks them (``_kl_cov_top``). ``selected[B, T]`` (from :func:`cov_selection`) replaces the
    selection. Metrics: cov_kl_frac, kl_abs_mean (mean |log r|), approx_kl.
    """
    logp, old_logp, adv, mask, is_weights = _inputs(logp, old_logp, advantages, mask, is_weights)
    check_positive("kl_cov_ratio", cov_fraction)
    if not kl_coef >= 0:
        raise ValueError(f"kl_cov_coef: expected ≥ 0, got {kl_coef}")
    lr = log_ratio(logp, old_logp)
    per_token = -adv * torch.exp(lr)
    with torch.no_grad():
        if selected is None:
            pick = _select("kl", logp, old_logp, adv, mask, 0.0, 0.0, cov_fraction, 0.0, 0.0, None, center, num_select)
        else:
            pick = selected.bool() & mask
        n = mask.sum().clamp_min(1)
        metrics: Metrics = {
            "loss/cov_kl_frac": metric(pick.sum() / n),
            "loss/kl_abs_mean": metric(masked_mean(lr.abs(), mask)),
            "loss/approx_kl": metric(masked_mean(-lr, mask)),
        }
    per_token = per_token + torch.where(pick, kl_coef * lr.abs(), torch.zeros_like(lr))
    return _finish(per_token, mask, is_weights, aggregation, loss_denominator, metrics)
