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
- Step-global statistics come from three phases the training loop calls per minibatch:
  ``prepare_corrections`` (whole minibatch, all ranks: π_θ-free rejection, IS weights with
  batch normalisation, the loss denominator), ``policy_loss`` per microbatch with grad, and
  ``policy_loss`` once more on the gathered detached π_θ for exact minibatch metrics.
  ``compute_policy_loss`` is the three on one batch.
- Truncated IS is computed over the kept tokens, so batch normalisation is over what
  enters the loss. IcePop together with TIS gives min(ρ, C)·1[band] (the band mask times
  the truncated weight), never two ratio factors (verl's token-IcePop preset is ρ·1[band]:
  IcePop alone, weighted).
- M2PO (``correction.m2po_tau``) bounds the second moment of the log ratio to the behaviour
  policy (seed 000: χ²(π‖μ) ≤ R²·M₂, M₂ = E[(log ρ)²]) over the tokens that survive rejection:
  ρ = π_old/μ in decoupled mode (AReaL's proximal vs behaviour log-probs), sg[π_θ]/μ in bypass
  mode (the no-grad pre-pass). It couples all tokens of the minibatch (``prepare_corrections``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moe_rl.algo.aggregation import AGGREGATIONS, aggregate, default_denominator
from moe_rl.algo.importance import icepop_weights, sequence_icepop_weights, truncated_is_weights
from moe_rl.algo.kl import kl_penalty
from moe_rl.algo.metrics import offpolicy_metrics_unchecked
from moe_rl.algo.registry import LossConfigLike, LossInputs, get_policy_loss_fn, surrogate_loss
from moe_rl.algo.rejection import chained_rejection_mask, opsm_mask, rejection_mask, token_veto, trm_mask
from moe_rl.algo.tensors import check_logp, check_mask, check_seq_or_token, metric, seq_valid
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
    # Optional (defaults when absent): icepop_level ("token"), rejection ([]), m2po_tau (None),
    # trm_delta (None), trm_estimator ("k3").


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


def _sequence_free_rejection(cfg, source, rollout, mask, metrics):
    """Rejection that needs no π_θ (rs_mode / rejection list, token veto): step-global, in ``prepare_corrections``."""
    keep = mask
    if cfg.rs_mode is not None:
        k, m = rejection_mask(source, rollout, mask, cfg.rs_mode, cfg.rs_lower, cfg.rs_upper)
        keep, metrics = keep & k, metrics | m
    if getattr(cfg, "rejection", None):
        k, m = chained_rejection_mask(source, rollout, mask, cfg.rejection)
        keep, metrics = keep & k, metrics | m
    if cfg.token_veto_threshold is not None:
        k, m = token_veto(source, rollout, mask, cfg.token_veto_threshold)
        keep, metrics = keep & k, metrics | m
    if getattr(cfg, "trm_delta", None) is not None:
        k, m = trm_mask(source, rollout, mask, cfg.trm_delta, getattr(cfg, "trm_estimator", "k3"))
        keep, metrics = keep & k, metrics | m
    return keep, metrics


def _is_weights(cfg, loss_type, source, rollout, mask, keep, metrics):
    """IS weights to multiply into the loss (or None), plus their metrics.

    IcePop alone: k·1[band] (``icepop_weighted``) or 1[band], on token ratios or (``icepop_level``
    sequence / geometric) on each sequence's ratio. TIS alone: min(ρ, C) (token or sequence).
    Both: the band mask times the truncated weight, min(ρ, C)·1[band], since two ratio factors
    would count π_old/μ twice. verl's token-IcePop preset is ρ·1[band], i.e. IcePop alone
    with ``icepop_weighted`` (docs/algo.md).
    """
    is_level = "none" if cfg.is_level is None else cfg.is_level
    if is_level not in ("none", "token", "sequence"):
        raise ValueError(f"correction.is_level: expected 'none', 'token' or 'sequence', got {cfg.is_level!r}")
    ratio_in_bypass = cfg.mode == "bypass" and get_policy_loss_fn(loss_type).anchored
    band = None
    if cfg.icepop:
        # A ratio factor is never applied to a ratio loss in bypass (π_θ/μ is already in it),
        # and not twice when TIS supplies the weight: then IcePop contributes only its mask.
        weighted = cfg.icepop_weighted and not ratio_in_bypass and is_level == "none"
        level = getattr(cfg, "icepop_level", "token")
        if level == "token":
            band, m = icepop_weights(source, rollout, mask, cfg.icepop_low, cfg.icepop_high, weighted)
        elif level in ("sequence", "geometric"):
            band, m = sequence_icepop_weights(
                source, rollout, mask, cfg.icepop_low, cfg.icepop_high, weighted, geometric=level == "geometric"
            )
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


@dataclass
class PreparedCorrections:
    """Step-global corrections of one minibatch, computed once over all its samples.

    ``keep[N, T]``: tokens entering the loss after the π_θ-free rejections (rs_mode, token veto);
    ``weights[N, T]``: detached IS weights to multiply into each token's loss (None = none),
    batch normalisation included; ``denominator``: the aggregation's divisor over the whole
    minibatch (kept tokens, kept sequences, or N·norm_len); ``metrics``: rejection / IS metrics.
    Rows are samples, so the caller can slice rows (and re-lay positions) into microbatches.
    """

    keep: torch.Tensor
    weights: torch.Tensor | None
    denominator: float
    metrics: dict[str, torch.Tensor]
    cov_selected: torch.Tensor | None = None  # [N, T] Clip-Cov / KL-Cov tokens; pass rows to policy_loss


def needs_policy_prepass(
    correction_cfg: CorrectionConfigLike, loss_cfg: LossConfigLike | None = None, optim_cfg=None
) -> bool:
    """True when the minibatch's corrections need π_θ before the update (a no-grad forward).

    Only bypass mode measures its corrections on π_θ (π_old ≔ μ): rejection, IS weights, IcePop,
    M2PO and VCPO's ESS lr scaling (``optim_cfg.ess_lr_scaling``) all read sg[π_θ]/μ there; in
    decoupled mode they are functions of π_old and μ, both known before the update. A loss that
    registers a token selection (Clip-Cov, KL-Cov) selects by π_θ in both modes.
    """
    c = correction_cfg
    if loss_cfg is not None and get_policy_loss_fn(loss_cfg.type).select is not None:
        return True  # the loss's token selection is a function of π_θ over the whole minibatch
    if c.mode != "bypass":
        return False
    is_level = "none" if c.is_level is None else c.is_level
    rejects = c.rs_mode is not None or bool(getattr(c, "rejection", None)) or c.token_veto_threshold is not None
    rejects = rejects or getattr(c, "trm_delta", None) is not None
    m2po = getattr(c, "m2po_tau", None) is not None
    ess = bool(getattr(optim_cfg, "ess_lr_scaling", False))
    return rejects or is_level != "none" or bool(c.icepop) or m2po or ess


def _denominator(aggregation: str, keep: torch.Tensor, norm_len: int | None) -> float:
    return float(default_denominator(keep, aggregation, norm_len))


@torch.no_grad()
def prepare_corrections(
    loss_cfg: LossConfigLike,
    correction_cfg: CorrectionConfigLike,
    source_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    norm_len: int | None = None,
    policy_logp: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    loss_mask: torch.Tensor | None = None,
) -> PreparedCorrections:
    """Phase 1 of a minibatch: rejection, IS weights and the loss denominator over ALL its samples.

    ``source_logp[N, T]`` is the numerator of the correction ratio: π_old in decoupled mode,
    π_θ (no-grad pre-pass; the weights do not change within a minibatch) in bypass mode.
    ``rollout_logp[N, T]`` is μ and ``mask[N, T]`` the valid response tokens. Called on the
    whole minibatch (every microbatch, every data-parallel rank), so batch normalisation,
    the denominator and the fractions do not depend on micro_batch_size or dp size.
    Sequence-local corrections that need π_θ (OPSM) are applied per microbatch in
    ``policy_loss``; the sequences they drop stay in the denominator (as IcePop's band does).
    ``norm_len`` defaults to ``loss_cfg.norm_len``. M2PO (``correction.m2po_tau``) masks on
    (log ``source_logp`` − log μ)² — π_old/μ in decoupled mode, sg[π_θ]/μ in bypass mode — over the
    tokens that survive the rejections, so its budget (and ``m2po/m2_after``) is over what enters
    the loss. ``policy_logp[N, T]`` is π_θ from the no-grad pre-pass. For ``loss.type`` clip_cov / kl_cov,
    ``policy_logp`` and ``advantages`` ([N] or [N, T]) give the step-global token selection
    (``cov_selected``; Clip-Cov draws with ``generator``, seeded from train.seed, step and
    minibatch — identical on every rank, which all see the gathered rows); without them each
    ``policy_loss`` call selects on its own microbatch. ``loss_mask[N, T]`` removes tokens from the
    loss (and its denominator) like a rejection, while the off-policy metrics still see them.
    """
    if loss_cfg.aggregation not in AGGREGATIONS:
        raise ValueError(f"loss.aggregation: expected one of {AGGREGATIONS}, got {loss_cfg.aggregation!r}")
    mask = check_mask(mask)
    rollout = check_logp("rollout_logp", rollout_logp.detach(), mask)
    source = check_logp("source_logp", source_logp.detach(), mask)
    keep, metrics = _sequence_free_rejection(correction_cfg, source, rollout, mask, {})
    if loss_mask is not None:  # tokens kept out of the loss before any correction (train.mask_truncated)
        keep = keep & loss_mask.to(keep.device).bool()
    if getattr(correction_cfg, "m2po_tau", None) is not None:  # the behaviour ratio, after rejection
        k, m = m2po_mask(source, rollout, keep, correction_cfg.m2po_tau)
        keep, metrics = keep & k, metrics | m
    if norm_len is None:
        norm_len = getattr(loss_cfg, "norm_len", None)
    weights, metrics = _is_weights(correction_cfg, loss_cfg.type, source, rollout, mask, keep, metrics)
    loss, selected = get_policy_loss_fn(loss_cfg.type), None
    if loss.select is not None and policy_logp is not None and advantages is not None:
        anchor = rollout if correction_cfg.mode == "bypass" else source
        x = LossInputs(policy_logp.detach(), anchor, advantages, keep, generator=generator).checked()
        selected = loss.select(x, loss.params.from_config(loss_cfg)) if bool(x.mask.any()) else torch.zeros_like(x.mask)
    return PreparedCorrections(keep, weights, _denominator(loss_cfg.aggregation, keep, norm_len), metrics, selected)


def policy_loss(
    loss_cfg: LossConfigLike,
    correction_cfg: CorrectionConfigLike,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    keep: torch.Tensor,
    weights: torch.Tensor | None,
    denominator: float,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    cov_selected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Phase 2 (per microbatch, with grad) and phase 3 (whole minibatch, detached, for metrics).

    ``keep[B, T]`` / ``weights[B, T]`` / ``denominator`` come from ``prepare_corrections`` on the
    whole minibatch (rows and positions re-laid for this microbatch). The loss is a sum over
    this microbatch's tokens divided by the global denominator, so summing it over microbatches
    and ranks gives the minibatch loss. Called once more on the gathered, detached π_θ of the
    whole minibatch, its metrics (clip fractions, ratios, OPSM, off-policy diagnostics, KL,
    entropy) are step-global and its loss equals that sum. ``generator`` seeds Clip-Cov's
    random token selection (seed it from train.seed, step, epoch and minibatch, not the rank) when no
    ``cov_selected[B, T]`` (rows of ``PreparedCorrections.cov_selected``) is given. The loss is
    multiplied by ``loss.scale_factor``; the KL to the reference is logged as ``loss/kl_ref``.
    """
    get_policy_loss_fn(loss_cfg.type)  # an unknown loss.type fails before any work
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

    metrics = offpolicy_metrics_unchecked(source, rollout, mask)
    keep = keep & mask
    if correction_cfg.opsm_delta is not None:
        k, m = opsm_mask(logp_c, rollout, mask, adv, correction_cfg.opsm_delta)
        keep, metrics = keep & k, metrics | m
    metrics["correction/kept_token_frac"] = metric(keep.sum() / mask.sum())
    metrics["correction/kept_seq_frac"] = metric(seq_valid(keep).sum() / seq_valid(mask).sum())

    agg, den = loss_cfg.aggregation, denominator
    if not bool(keep.any()):
        pg = (logp_c * 0).sum()  # everything rejected: zero loss, zero gradient, graph intact
        metrics["loss/pg_loss"] = metric(pg)
    else:
        x = LossInputs(logp_c, anchor, adv, keep, weights, agg, den, generator, cov_selected)
        pg, m = surrogate_loss(loss_cfg, x)
        metrics |= m

    total = pg
    if loss_cfg.kl_coef:
        kl = aggregate(kl_penalty(logp_c, ref, loss_cfg.kl_estimator), keep, agg, den)
        total = total + loss_cfg.kl_coef * kl
        metrics["loss/kl_ref"] = metric(kl)
    if ent_c is not None:
        ent = aggregate(ent_c, keep, agg, den)
        total = total - loss_cfg.entropy_coef * ent
        metrics["loss/entropy"] = metric(ent)
    scale = getattr(loss_cfg, "scale_factor", 1.0)
    if scale != 1.0:
        if not scale > 0:
            raise ValueError(f"loss.scale_factor: expected a number > 0, got {scale}")
        total = total * scale
    metrics["loss/total"] = metric(total)
    return total, metrics


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
    norm_len: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total policy loss and flat ``group/name`` metrics (detached 0-d tensors) of ONE batch.

    Inputs: ``logp[B, T]`` (π_θ, grad), ``old_logp[B, T]`` (π_old; None or == rollout in
    bypass), ``rollout_logp[B, T]`` (μ), ``advantages[B]`` or ``[B, T]``, ``mask[B, T]``,
    optional ``ref_logp[B, T]`` (needed when kl_coef > 0), ``entropy[B, T]`` (needed when
    entropy_coef > 0), ``loss_denominator`` (overrides the batch's own divisor).
    loss = pg_loss + kl_coef · agg(KL) − entropy_coef · agg(entropy), all aggregated over
    the kept mask. If rejection removes every token the loss is a graph-connected zero.
    This is ``prepare_corrections`` + ``policy_loss`` on one batch; the training loop calls the
    phases itself so that a minibatch split into microbatches and ranks gives the same step.
    """
    mask = check_mask(mask)
    rollout = check_logp("rollout_logp", rollout_logp.detach(), mask)
    _, source = _anchor_and_source(correction_cfg.mode, logp, old_logp, rollout, mask)
    prepared = prepare_corrections(
        loss_cfg,
        correction_cfg,
        source,
        rollout,
        mask,
        norm_len=norm_len,
        policy_logp=logp.detach(),
        advantages=advantages,
        generator=generator,
    )
    den = prepared.denominator if loss_denominator is None else loss_denominator
    total, metrics = policy_loss(
        loss_cfg,
        correction_cfg,
        logp,
        old_logp,
        rollout,
        advantages,
        mask,
        prepared.keep,
        prepared.weights,
        den,
        ref_logp=ref_logp,
        entropy=entropy,
        cov_selected=prepared.cov_selected,
    )
    return total, prepared.metrics | metrics
