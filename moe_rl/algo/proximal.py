"""A-3PO: the proximal (trust-region anchor) log-probs approximated by staleness-aware log-linear interpolation.

Owns :func:`a3po_proximal_logp`, AReaL's ``prox_logp_method: loglinear`` (A-3PO, Li et al. 2025,
arXiv:2512.06547; seed 000: "approximates [the proximal anchor] through log-probability interpolation
weighted by staleness, eliminating a forward pass"). The training step calls it under
``correction.prox_logp_method: loglinear`` (``moe_rl.train.update``), in place of the old-log-prob pass, and
:func:`a3po_needs_prepass` says when it needs π_θ before the update (a no-grad forward of the minibatch): only
when a minibatch-wide statistic reads π_prox; otherwise π_prox is interpolated from the update's own forward,
as AReaL does.
"""

from __future__ import annotations

import torch

from moe_rl.algo.registry import get_policy_loss_fn
from moe_rl.algo.tensors import Metrics, check_logp, check_mask, masked_mean, metric


def a3po_needs_prepass(correction_cfg, loss_cfg, optim_cfg=None) -> bool:
    """True when A-3PO's π_prox must be known for the whole minibatch before its first backward.

    The statistics that read π_prox across the minibatch: rejection (``rs_mode``, ``rejection``,
    ``token_veto_threshold``, ``trm_delta``: the tokens they drop leave the loss denominator, a count over the
    minibatch that every microbatch's loss is divided by), M2PO (``m2po_tau``: a sort of all the minibatch's
    (log ρ)²), batch-normalised TIS (``is_batch_normalize``: the mean weight over the minibatch), VCPO's ESS lr
    (``optim.ess_lr_scaling``: the minibatch's ESS sets the lr before the forwards) and a loss's token selection
    (Clip-Cov, KL-Cov: a top-k of π_θ over the minibatch). Per-token or per-sequence corrections (IcePop at
    every level, TIS without batch normalisation, OPSM) are computed per microbatch from the update's forward.
    """
    c = correction_cfg
    if get_policy_loss_fn(loss_cfg.type).select is not None:
        return True
    rejects = c.rs_mode is not None or bool(getattr(c, "rejection", None)) or c.token_veto_threshold is not None
    rejects = rejects or getattr(c, "trm_delta", None) is not None or getattr(c, "m2po_tau", None) is not None
    batch_norm = c.is_level not in (None, "none") and bool(c.is_batch_normalize)
    return rejects or batch_norm or bool(getattr(optim_cfg, "ess_lr_scaling", False))


def a3po_proximal_logp(
    rollout_logp: torch.Tensor,
    logp: torch.Tensor,
    mask: torch.Tensor,
    token_versions: torch.Tensor,
    current_version: int,
) -> tuple[torch.Tensor, Metrics]:
    """log π_prox[B, T] = log μ + α·(sg[log π_θ] − log μ), α = clamp((v_prox − v_μ)/(v_θ − v_μ), 0, 1).

    AReaL ``compute_prox_logp_approximations(method='loglinear')``: v_θ = ``current_version``, v_prox =
    v_θ − 1 (the last broadcast weights), v_μ = ``token_versions[B, T]`` (the version that generated each
    token); α = 0 where v_θ ≤ v_μ or the version is negative (no generation version), so a token from the
    last broadcast weights keeps log μ and a token one version staler sits halfway. Detached. Outside the
    mask the value is log μ. Metrics: ``a3po/alpha_mean``, ``a3po/prox_minus_behav_mean``.
    """
    mask = check_mask(mask, allow_empty=True)
    roll = check_logp("rollout_logp", rollout_logp.detach(), mask)
    cur = check_logp("logp", logp.detach(), mask)
    if token_versions.shape != mask.shape:
        raise ValueError(f"token_versions: expected shape {tuple(mask.shape)}, got {tuple(token_versions.shape)}")
    v_mu = token_versions.to(roll.dtype)
    v_theta = float(current_version)
    diff = v_theta - v_mu
    alpha = torch.where((diff > 0) & (token_versions >= 0) & mask, (v_theta - 1 - v_mu) / diff.clamp_min(1), 0.0)
    alpha = alpha.clamp(0.0, 1.0)
    prox = roll + alpha * (cur - roll)
    return prox, {
        "a3po/alpha_mean": metric(masked_mean(alpha, mask)),
        "a3po/prox_minus_behav_mean": metric(masked_mean(prox - roll, mask)),
    }
