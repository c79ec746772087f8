"""The one entry point the trainer calls: config sections + three log-prob tensors → loss, metrics.

Owns the wiring of corrections into losses (which policy is the trust-region anchor,
which ratio the corrections measure, where IS weights apply) so that the trainer
holds no algorithm branches. The three policies (seed 003, "The Three-Policy
Framework"; seed 000, "Notation map"): μ = ``rollout_logp`` (SGLang), π_old =
``old_logp`` (learner at rollout weights), π_θ = ``logp`` (learner, with grad).

- ``decoupled``: corrections measure ρ = π_old/μ; PPO/GSPO/CISPO clip r = π_θ/π_old;
  IS weights (TIS or weighted IcePop) multiply every loss.
- ``bypass``: π_old ≔ μ. Corrections measure sg[π_θ]/μ; ratio losses clip π_θ/μ, which
  already is the IS correction, so PPO-clip / GSPO / CISPO never multiply IS weights
  again (IcePop keeps only its 0/1 band mask there); REINFORCE applies the weights
  explicitly (seed 000, "Bypass mode loss").
- Rejection (rs_mode, token veto, OPSM) always applies: each is computed on the input
  mask and the keep masks are AND-ed. OPSM always compares π_θ with μ (DeepSeek-V3.2).
- Truncated IS is computed over the kept tokens, so batch normalisation is over what
  enters the loss. IcePop together with TIS gives min(ρ, C)·1[band] (the band mask times
  the truncated weight), never two ratio factors (verl's token-IcePop preset is ρ·1[band]:
  IcePop alone, weighted).
"""

from __future__ import annotations

from typing import Protocol

import torch

from moe_rl.algo._tensors import check_logp, check_mask, check_seq_or_token, metric, seq_valid
from moe_rl.algo.aggregation import AGGREGATIONS, aggregate, default_denominator
from moe_rl.algo.importance import icepop_weights, sequence_icepop_weights, truncated_is_weights
from moe_rl.algo.kl import kl_penalty
from moe_rl.algo.metrics import _offpolicy_metrics
from moe_rl.algo.rejection import chained_rejection_mask, opsm_mask, rejection_mask, token_veto
from moe_rl.algo.surrogates import LOSS_TYPES, RATIO_LOSSES, surrogate_loss
from moe_rl.algo.variance_control import m2po_mask


class CorrectionConfigLike(Protocol):
    """Attributes read from the config's ``correction`` section (moe_rl.config.CorrectionConfig)."""

    mode: str  # "bypass" | "decoupled"
    is_level: str | None  # "none" | "token" | "sequence"
    is_threshold: float
    is_batch_normalize: bool
    rs_mode: str | None  # one of rejection.RS_MODES
    rs_lower: float | None
    rs_upper: float | None
    icepop: bool
    icepop_low: float
    icepop_high: float
    icepop_weighted: bool
    token_veto_threshold: float | None
    opsm_delta: float | None
    # Optional (defaults when absent): icepop_level ("token"), rejection ([]), m2po_tau (None).


class LossConfigLike(Protocol):
    """Attributes read from the config's ``loss`` section (moe_rl.config.LossConfig).

    Optional (schema defaults when absent): ``cispo_clip_low`` (None = no lower bound),
    ``cispo_clip_high`` (None = ``clip_high``), the per-loss fields of ``surrogates.surrogate_loss``,
    ``norm_len`` (None) and ``scale_factor`` (1.0).
    """

    type: str
    clip_low: float
    clip_high: float
    dual_clip_c: float | None
    aggregation: str
    kl_coef: float
    kl_estimator: str
    entropy_coef: float


def _anchor_and_source(mode, logp, old_logp, rollout, mask):
    """(trust-region anchor, numerator of the correction ratio) for the mode."""
    if mode == "decoupled":
        if old_logp is None:
            raise ValueError("old_logp: decoupled mode needs π_old log-probs [B, T], got None")
        old = check_logp("old_logp", old_logp.detach(), mask)
        return old, old
    if mode == "bypass":
        if old_logp is not None and not torch.equal(check_logp("old_logp", old_logp.detach(), mask), rollout):
            raise ValueError("old_logp: bypass mode sets π_old = μ; pass None or rollout_logp, got another tensor")
        return rollout, check_logp("logp", logp.detach(), mask)
    raise ValueError(f"correction.mode: expected 'bypass' or 'decoupled', got {mode!r}")


def _rejection(cfg, source, rollout, mask, logp, anchor, advantages, metrics):
    keep = mask
    if cfg.rs_mode is not None:
        k, m = rejection_mask(source, rollout, mask, cfg.rs_mode, cfg.rs_lower, cfg.rs_upper)
        keep, metrics = keep & k, metrics | m
    if getattr(cfg, "rejection", None):
        k, m = chained_rejection_mask(source, rollout, mask, cfg.rejection)
        keep, metrics = keep & k, metrics | m
    if getattr(cfg, "m2po_tau", None) is not None:
        # ρ of the loss's trust region: π_θ / π_old (decoupled) or π_θ / μ (bypass, anchor = μ).
        k, m = m2po_mask(logp, anchor, mask, cfg.m2po_tau)
        keep, metrics = keep & k, metrics | m
    if cfg.token_veto_threshold is not None:
        k, m = token_veto(source, rollout, mask, cfg.token_veto_threshold)
        keep, metrics = keep & k, metrics | m
    if cfg.opsm_delta is not None:
        k, m = opsm_mask(logp, rollout, mask, advantages, cfg.opsm_delta)
        keep, metrics = keep & k, metrics | m
    return keep, metrics


def _is_weights(cfg, loss_type, source, rollout, mask, keep, metrics):
    """IS weights to multiply into the loss (or None), plus their metrics.

    IcePop alone: k·1[band] (``icepop_weighted``) or 1[band]. TIS alone: min(ρ, C) (token or
    sequence). Both: the band mask times the truncated weight, min(ρ, C)·1[band], since two
    ratio factors would count π_old/μ twice. (verl's token-IcePop preset is ρ·1[band], i.e.
    IcePop alone with ``icepop_weighted``; see docs/algo.md.)
    """
    is_level = "none" if cfg.is_level is None else cfg.is_level
    if is_level not in ("none", "token", "sequence"):
        raise ValueError(f"correction.is_level: expected 'none', 'token' or 'sequence', got {cfg.is_level!r}")
    ratio_in_bypass = cfg.mode == "bypass" and loss_type in RATIO_LOSSES
    band = None
    if cfg.icepop:
        # A ratio factor is never applied to a ratio loss in bypass (π_θ/μ is already in it),
        # and not twice when TIS supplies the weight: then IcePop contributes only its mask.
        weighted = cfg.icepop_weighted and not ratio_in_bypass and is_level == "none"
        level = getattr(cfg, "icepop_level", "token")
        if level == "token":
            band, m = icepop_weights(source, rollout, mask, cfg.icepop_low, cfg.icepop_high, weighted)
        elif level in ("sequence", "geometric"):
            band, m = sequence_icepop_weights(source, rollout, mask, cfg.icepop_low, cfg.icepop_high, weighted,
                                              geometric=level == "geometric")  # fmt: skip
        else:
            raise ValueError(f"correction.icepop_level: expected 'token', 'sequence' or 'geometric', got {level!r}")
        metrics = metrics | m
    weights = None
    if is_level != "none" and bool(keep.any()):
        weights, m = truncated_is_weights(source, rollout, keep, is_level, cfg.is_threshold, cfg.is_batch_normalize)
        metrics = metrics | m
        metrics["is/applied"] = metric(0.0 if ratio_in_bypass else 1.0)
        if ratio_in_bypass:
            weights = None  # logged, never applied: it would count π_θ/μ twice
    if band is None:
        return weights, metrics
    return (band if weights is None else band * weights), metrics


def compute_policy_loss(
    loss_cfg: LossConfigLike,
    correction_cfg: CorrectionConfigLike,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    loss_denominator: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total policy loss and flat ``group/name`` metrics (detached 0-d tensors).

    Inputs: ``logp[B, T]`` (π_θ, grad), ``old_logp[B, T]`` (π_old; None or == rollout in
    bypass), ``rollout_logp[B, T]`` (μ), ``advantages[B]`` or ``[B, T]``, ``mask[B, T]``,
    optional ``ref_logp[B, T]`` (needed when kl_coef > 0), ``entropy[B, T]`` (needed when
    entropy_coef > 0), ``loss_denominator`` (global normaliser, see ``aggregate``; without it
    ``seq_mean_token_sum_norm`` divides by B · ``loss.norm_len``), ``generator`` (Clip-Cov's
    random selection). loss = scale_factor · (pg_loss + kl_coef · agg(KL) − entropy_coef ·
    agg(entropy)), all aggregated over the kept mask; the KL to the reference is logged as
    ``loss/kl_ref``. If rejection removes every token the loss is a graph-connected zero.
    """
    loss_type = loss_cfg.type
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss.type: expected one of {LOSS_TYPES}, got {loss_type!r}")
    if loss_cfg.aggregation not in AGGREGATIONS:
        raise ValueError(f"loss.aggregation: expected one of {AGGREGATIONS}, got {loss_cfg.aggregation!r}")
    mask = check_mask(mask)
    rollout = check_logp("rollout_logp", rollout_logp.detach(), mask)
    logp_c = check_logp("logp", logp, mask)
    adv = check_seq_or_token("advantages", advantages.detach(), mask)
    anchor, source = _anchor_and_source(correction_cfg.mode, logp, old_logp, rollout, mask)
    if loss_cfg.kl_coef and ref_logp is None:
        raise ValueError(f"ref_logp: loss.kl_coef={loss_cfg.kl_coef} needs reference log-probs [B, T], got None")
    if loss_cfg.entropy_coef and entropy is None:
        raise ValueError(f"entropy: loss.entropy_coef={loss_cfg.entropy_coef} needs entropy [B, T], got None")
    ref = None if ref_logp is None else check_logp("ref_logp", ref_logp.detach(), mask)
    ent_c = None if entropy is None else check_logp("entropy", entropy, mask)

    metrics = _offpolicy_metrics(source, rollout, mask)
    keep, metrics = _rejection(correction_cfg, source, rollout, mask, logp_c, anchor, adv, metrics)
    weights, metrics = _is_weights(correction_cfg, loss_type, source, rollout, mask, keep, metrics)
    metrics["correction/kept_token_frac"] = metric(keep.sum() / mask.sum())
    metrics["correction/kept_seq_frac"] = metric(seq_valid(keep).sum() / seq_valid(mask).sum())

    agg = loss_cfg.aggregation
    norm_len = getattr(loss_cfg, "norm_len", None)
    if loss_denominator is None and agg == "seq_mean_token_sum_norm":
        loss_denominator = default_denominator(mask, agg, norm_len)
    if not bool(keep.any()):
        pg = (logp_c * 0).sum()  # everything rejected: zero loss, zero gradient, graph intact
        metrics["loss/pg_loss"] = metric(pg)
    else:
        pg, m = surrogate_loss(loss_cfg, logp_c, anchor, adv, keep, weights, loss_denominator, generator)
        metrics |= m

    total = pg
    if loss_cfg.kl_coef:
        kl = aggregate(kl_penalty(logp_c, ref, loss_cfg.kl_estimator), keep, agg, loss_denominator)
        total = total + loss_cfg.kl_coef * kl
        metrics["loss/kl_ref"] = metric(kl)
    if ent_c is not None:
        ent = aggregate(ent_c, keep, agg, loss_denominator)
        total = total - loss_cfg.entropy_coef * ent
        metrics["loss/entropy"] = metric(ent)
    scale = getattr(loss_cfg, "scale_factor", 1.0)
    if scale != 1.0:
        if not scale > 0:
            raise ValueError(f"loss.scale_factor: expected a number > 0, got {scale}")
        total = total * scale
    metrics["loss/total"] = metric(total)
    return total, metrics
