"""Covariance-selected token losses: Clip-Cov and KL-Cov (Cui et al. 2025, arXiv:2505.22617).

Both score every valid token by the centred product cov_t = (A_t − Ā)(log π_θ(y_t) − mean log π_θ)
and treat the high-covariance tokens specially: Clip-Cov zeroes a random sample of them in
the PPO-clip loss, KL-Cov adds β|log r_t| to the top fraction. Registered like ``moe_rl.algo.losses``.
The centring means and the selection count couple all tokens of a minibatch, so each registers its
selection: ``prepare_corrections`` computes it once per minibatch (phase 1, on the no-grad pre-pass
π_θ, which equals the step's π_θ) and each microbatch passes its rows as ``LossInputs.selected``;
without it each call selects on what it sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algo.losses import clip_bounds
from moe_rl.algo.registry import LossInputs, LossParams, register_policy_loss
from moe_rl.algo.tensors import Metrics, check_positive, log_ratio, masked_mean, metric


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


def _kl_cov_top(logp, adv, mask, k):
    """Flat indices of KL-Cov's top-k tokens by covariance, computed as verl's ``compute_policy_loss_kl_cov``.

    The valid tokens in row-major order, centred by their own means, ``torch.topk``
    on the CPU: equal covariances (e.g. one sequence in the minibatch, so A − Ā = 0 everywhere)
    are then broken exactly as verl breaks them — an order torch leaves unspecified, which changes
    with the token count, so only the same computation on the same values reproduces it.
    """
    idx = mask.reshape(-1).nonzero().squeeze(1)
    a = adv.detach().reshape(-1)[idx].cpu()
    lp = logp.detach().reshape(-1)[idx].cpu()
    cov = (a - a.mean()) * (lp - lp.mean())
    return idx[torch.topk(cov, min(k, cov.numel())).indices.to(idx.device)]


@dataclass(frozen=True)
class ClipCovParams(LossParams):
    """PPO's ``loss.clip_low`` / ``loss.clip_high``; ``loss.clip_cov_ratio`` (fraction of tokens zeroed) and the
    candidate band ``loss.clip_cov_lb`` < cov_t < ``loss.clip_cov_ub``."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0


@dataclass(frozen=True)
class KLCovParams(LossParams):
    """``loss.kl_cov_ratio`` (fraction of tokens penalised) and ``loss.kl_cov_coef`` β on |log r|."""

    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 0.1


@torch.no_grad()
def clip_cov_selection(x: LossInputs, p: ClipCovParams) -> torch.Tensor:
    """The ``[B, T]`` tokens Clip-Cov zeroes: k = max(1, ⌊clip_cov_ratio·N⌋) drawn with ``x.generator``.

    Candidates are the valid tokens not already clipped by PPO with clip_cov_lb < cov_t < clip_cov_ub,
    drawn uniformly without replacement. Over a whole minibatch (``prepare_corrections``) seed the
    generator from (train.seed, step, epoch, minibatch) and *not* the rank — every rank sees the same
    gathered rows and must draw the same tokens (``train/update.py``); the centring means and the
    count are then the minibatch's, so the selection does not depend on the microbatch split (verl
    selects per microbatch: docs/algo.md "Porting a verl config").
    """
    logp, adv, mask = x.logp, x.advantages, x.mask
    k = cov_selection_count(int(mask.sum()), p.clip_cov_ratio)
    picked = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    cov = token_covariance(logp, adv, mask)
    lo, hi = clip_bounds(p.clip_low, p.clip_high)
    ratio = torch.exp(log_ratio(logp.detach(), x.old_logp))
    clip_active = (-adv * ratio.clamp(lo, hi) > -adv * ratio) & mask
    candidates = (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub) & mask & ~clip_active
    idx = candidates.reshape(-1).nonzero().squeeze(1)
    perm = torch.randperm(idx.numel(), generator=x.generator, device="cpu").to(idx.device)
    picked[idx[perm[: min(k, idx.numel())]]] = True
    return picked.view_as(mask)


@torch.no_grad()
def kl_cov_selection(x: LossInputs, p: KLCovParams) -> torch.Tensor:
    """The ``[B, T]`` tokens KL-Cov penalises: the top k = max(1, ⌊kl_cov_ratio·N⌋) by cov_t (``_kl_cov_top``)."""
    mask = x.mask
    picked = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    picked[_kl_cov_top(x.logp, x.advantages, mask, cov_selection_count(int(mask.sum()), p.kl_cov_ratio))] = True
    return picked.view_as(mask)


def _selected(x: LossInputs, p, select) -> torch.Tensor:
    """``x.selected`` (the minibatch's rows) restricted to the mask, or this call's own selection."""
    if x.selected is not None:
        return x.selected.bool() & x.mask
    return select(x, p)


@register_policy_loss("clip_cov", ClipCovParams, select=clip_cov_selection)
def clip_cov_loss(x: LossInputs, p: ClipCovParams) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov: PPO-clip with the gradient (and loss) of a random few high-covariance tokens removed.

    The tokens of :func:`clip_cov_selection` (or ``x.selected``) get ℓ_t = 0; seed ``x.generator``
    from (train.seed, step, epoch, minibatch) — the same on every rank — so resume is exact.
    Metrics: cov_clip_frac (tokens zeroed), clip_frac (PPO), approx_kl.
    """
    adv, mask = x.advantages, x.mask
    lo, hi = clip_bounds(p.clip_low, p.clip_high)
    check_positive("clip_cov_ratio", p.clip_cov_ratio)
    lr = log_ratio(x.logp, x.old_logp)
    ratio = torch.exp(lr)
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(lo, hi)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clip_active = (clipped > unclipped) & mask
        drop = _selected(x, p, clip_cov_selection)
        n = mask.sum().clamp_min(1)
        metrics: Metrics = {
            "loss/cov_clip_frac": metric(drop.sum() / n),
            "loss/clip_frac": metric(clip_active.sum() / n),
            "loss/approx_kl": metric(masked_mean(-lr, mask)),
        }
    return torch.where(drop, torch.zeros_like(per_token), per_token), metrics


@register_policy_loss("kl_cov", KLCovParams, select=kl_cov_selection)
def kl_cov_loss(x: LossInputs, p: KLCovParams) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov: ℓ_t = −A_t r_t, plus β·|log r_t| on the top-k tokens by cov_t (k = max(1, ⌊fraction·N⌋)).

    No ratio clipping: the |log r| penalty on the highest-covariance tokens is the only
    constraint (verl ``kl_cov``, ``ppo_kl_coef`` = β). Ties at the k-th value are broken as verl
    breaks them (``_kl_cov_top``). ``x.selected`` replaces :func:`kl_cov_selection`.
    Metrics: cov_kl_frac, kl_abs_mean (mean |log r|), approx_kl.
    """
    mask = x.mask
    check_positive("kl_cov_ratio", p.kl_cov_ratio)
    if not p.kl_cov_coef >= 0:
        raise ValueError(f"kl_cov_coef: expected ≥ 0, got {p.kl_cov_coef}")
    lr = log_ratio(x.logp, x.old_logp)
    per_token = -x.advantages * torch.exp(lr)
    with torch.no_grad():
        pick = _selected(x, p, kl_cov_selection)
        n = mask.sum().clamp_min(1)
        metrics: Metrics = {
            "loss/cov_kl_frac": metric(pick.sum() / n),
            "loss/kl_abs_mean": metric(masked_mean(lr.abs(), mask)),
            "loss/approx_kl": metric(masked_mean(-lr, mask)),
        }
    return per_token + torch.where(pick, p.kl_cov_coef * lr.abs(), torch.zeros_like(lr)), metrics
