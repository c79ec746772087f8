"""Dispatch from ``loss.type`` to the surrogate-loss function with the config's parameters.

Owns only the mapping (which config fields each loss reads) so that ``policy_loss`` and
the trainer's per-microbatch phase call one function for every loss type.
"""

from __future__ import annotations

import torch

from moe_rl.algo.covariance_losses import clip_cov_loss, kl_cov_loss
from moe_rl.algo.losses import cispo_loss, gspo_loss, ppo_clip_loss, reinforce_loss
from moe_rl.algo.shaped_losses import dppo_loss, gmpo_loss, sapo_loss

LOSS_TYPES = (
    "ppo_clip", "gspo", "gspo_token", "cispo", "reinforce", "sapo", "gmpo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov",
)  # fmt: skip
# Losses whose ratio is anchored on π_old (μ in bypass mode), i.e. every loss but REINFORCE.
RATIO_LOSSES = tuple(t for t in LOSS_TYPES if t != "reinforce")


def surrogate_loss(
    loss_cfg,
    logp: torch.Tensor,
    anchor: torch.Tensor,
    adv: torch.Tensor,
    keep: torch.Tensor,
    weights: torch.Tensor | None,
    loss_denominator: float | None,
    generator: torch.Generator | None = None,
    cov_selected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss of ``loss_cfg.type`` on ``logp[B, T]`` (grad) vs ``anchor[B, T]`` over ``keep[B, T]``.

    ``adv`` is ``[B, T]``, ``weights[B, T]`` the detached IS weights (or None),
    ``generator`` seeds Clip-Cov's random selection; ``cov_selected[B, T]`` (the minibatch's
    phase-1 ``cov_selection``, rows of this call) replaces Clip-Cov's / KL-Cov's own selection. Optional config fields missing from a
    duck-typed ``loss_cfg`` take the schema defaults.
    """
    t = loss_cfg.type
    agg = loss_cfg.aggregation
    opt = lambda name, default: getattr(loss_cfg, name, default)  # noqa: E731
    common = {"is_weights": weights, "aggregation": agg, "loss_denominator": loss_denominator}
    if t == "ppo_clip":
        return ppo_clip_loss(logp, anchor, adv, keep, loss_cfg.clip_low, loss_cfg.clip_high, loss_cfg.dual_clip_c,
                             **common)  # fmt: skip
    if t in ("gspo", "gspo_token"):
        return gspo_loss(logp, anchor, adv, keep, loss_cfg.clip_low, loss_cfg.clip_high, t == "gspo_token", **common)
    if t == "cispo":
        hi = opt("cispo_clip_high", None)
        return cispo_loss(logp, anchor, adv, keep, opt("cispo_clip_low", None),
                          loss_cfg.clip_high if hi is None else hi, **common)  # fmt: skip
    if t == "reinforce":
        return reinforce_loss(logp, adv, keep, **common)
    if t == "sapo":
        return sapo_loss(logp, anchor, adv, keep, opt("sapo_tau_pos", 1.0), opt("sapo_tau_neg", 1.05), **common)
    if t == "gmpo":
        return gmpo_loss(logp, anchor, adv, keep, loss_cfg.clip_low, loss_cfg.clip_high, **common)
    if t in ("dppo_tv", "dppo_kl"):
        return dppo_loss(logp, anchor, adv, keep, t.removeprefix("dppo_"), loss_cfg.clip_low, loss_cfg.clip_high,
                         opt("dppo_ratio_cap", 20.0), **common)  # fmt: skip
    if t == "clip_cov":
        return clip_cov_loss(logp, anchor, adv, keep, loss_cfg.clip_low, loss_cfg.clip_high, opt("clip_cov_ratio", 2e-4),
                             opt("clip_cov_lb", 1.0), opt("clip_cov_ub", 5.0), generator=generator, selected=cov_selected,
                             **common)  # fmt: skip
    if t == "kl_cov":
        return kl_cov_loss(logp, anchor, adv, keep, opt("kl_cov_ratio", 2e-4), opt("kl_cov_coef", 0.1),
                           selected=cov_selected, **common)  # fmt: skip
    raise ValueError(f"loss.type: expected one of {LOSS_TYPES}, got {t!r}")
