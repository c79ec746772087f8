"""Second-moment and ESS controls on the importance ratio: M2PO's token mask and VCPO's step size.

Both couple every token / sequence of a minibatch, so the trainer computes them once per
minibatch (one optimizer step) on the gathered, detached log-probs, never per microbatch.
Sources: seed 000, "Second-moment trust regions" (M2PO, Zheng et al. 2025, arXiv:2510.01161)
and "ESS-guided variance control" (VCPO, Huang et al. 2026, arXiv:2602.17616).
"""

from __future__ import annotations

import math

import torch

from moe_rl.algo.tensors import check_logp, check_mask, check_positive, metric

Metrics = dict[str, torch.Tensor]

M2PO_DEFAULT_TAU = 0.04  # the paper's second-moment budget on log ρ


@torch.no_grad()
def m2po_mask(
    logp: torch.Tensor, anchor_logp: torch.Tensor, mask: torch.Tensor, tau: float = M2PO_DEFAULT_TAU
) -> tuple[torch.Tensor, Metrics]:
    """M2PO keep mask ``keep[B, T]``: drop the tokens with the largest (log ρ)² until the second moment fits.

    log ρ_t = log ``logp`` − log ``anchor_logp``: the ratio to the behaviour policy μ (seed 000's
    χ²(π‖μ) ≤ R²·M₂; the trainer passes π_old/μ in decoupled mode, sg[π_θ]/μ in bypass mode, on
    the tokens that survive rejection). Sorting the valid tokens by (log ρ)² ascending, the kept set is the
    longest prefix whose mean (log ρ)² is ≤ τ; every longer prefix exceeds it (the prefix mean
    of ascending values never decreases), so this masks the fewest tokens, always the largest.
    Ties are broken by position. Inputs ``logp[B, T]``, ``anchor_logp[B, T]``, ``mask[B, T]``.
    Metrics: ``m2po/masked_frac``, ``m2po/m2_before`` and ``m2po/m2_after`` (mean (log ρ)²).
    An all-False ``mask`` (rejection left nothing) keeps nothing and reports zeros.
    """
    mask = check_mask(mask, allow_empty=True)
    logp = check_logp("logp", logp.detach(), mask)
    anchor_logp = check_logp("anchor_logp", anchor_logp.detach(), mask)
    tau = check_positive("correction.m2po_tau", tau)
    sq = (logp - anchor_logp) ** 2
    flat_idx = mask.reshape(-1).nonzero().squeeze(1)
    values = sq.reshape(-1)[flat_idx]
    order = torch.sort(values, stable=True).indices
    prefix_mean = torch.cumsum(values[order], 0) / torch.arange(1, values.numel() + 1, device=values.device)
    fits = (prefix_mean <= tau).nonzero()
    n_keep = int(fits[-1]) + 1 if fits.numel() else 0
    keep = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    keep[flat_idx[order[:n_keep]]] = True
    keep = keep.view_as(mask)
    n = values.numel()
    if n == 0:  # nothing to measure (every token already rejected)
        zero = metric(0.0)
        return keep, {"m2po/masked_frac": zero, "m2po/m2_before": zero, "m2po/m2_after": zero}
    return keep, {
        "m2po/masked_frac": metric((n - n_keep) / n),
        "m2po/m2_before": metric(values.mean()),
        "m2po/m2_after": metric(prefix_mean[n_keep - 1] if n_keep else 0.0),
    }


def ess_fraction_from_sums(sum_w: torch.Tensor, sum_w2: torch.Tensor, n: torch.Tensor | int) -> torch.Tensor:
    """Normalised ESS (Σw)² / (N·Σw²) ∈ (0, 1] from step-global sums (all-reduce them with SUM first).

    The sums must be of weights scaled by one common factor (e.g. exp(log w − max log w),
    max taken over all ranks): the ratio is scale-free.
    """
    n = torch.as_tensor(n, dtype=sum_w.dtype, device=sum_w.device)
    return torch.where(sum_w2 > 0, sum_w * sum_w / (n * sum_w2), torch.ones_like(sum_w)).clamp(max=1.0)


def ess_lr_scale(
    seq_log_weights: torch.Tensor, valid: torch.Tensor | None = None, min_scale: float = 0.1
) -> tuple[torch.Tensor, Metrics]:
    """VCPO learning-rate multiplier ``clamp(sqrt(ESS / N), min_scale, 1)`` from ``seq_log_weights[N]``.

    w_i = exp(Σ_t log ρ_{i,t}), the sequence importance weight of each of the minibatch's N
    sequences (ρ = π_θ/μ as the paper defines it; in decoupled mode the trainer passes
    π_old/μ, in bypass mode sg[π_θ]/μ from the no-grad pre-pass). ESS/N = (Σw)²/(N Σw²) is
    computed shifted by max log w, so no weight overflows. The square root is the step-size
    rule VCPO uses for Adam-type optimisers (update ∝ lr, gradient noise ∝ 1/√ESS); the clamp
    keeps at least ``min_scale`` of the lr so a degenerate batch still moves. ``valid[N]``
    selects sequences (default all). Metrics: ``vcpo/ess_frac``, ``vcpo/lr_scale``.
    """
    if not isinstance(seq_log_weights, torch.Tensor) or seq_log_weights.dim() != 1:
        raise ValueError("seq_log_weights: expected a 1-D tensor [N] of sequence log importance weights")
    min_scale = check_positive("optim.ess_lr_min_scale", min_scale)
    if min_scale > 1:
        raise ValueError(f"optim.ess_lr_min_scale: expected a number in (0, 1], got {min_scale}")
    valid = torch.ones_like(seq_log_weights, dtype=torch.bool) if valid is None else valid.bool()
    lw = seq_log_weights.detach().double()
    if not bool(valid.any()):
        return torch.ones((), dtype=torch.float32), {"vcpo/ess_frac": metric(1.0), "vcpo/lr_scale": metric(1.0)}
    if not bool(torch.isfinite(lw[valid]).all()):
        raise ValueError("seq_log_weights: expected finite values at valid sequences")
    shifted = torch.where(valid, torch.exp(lw - lw[valid].max()), torch.zeros_like(lw))
    frac = ess_fraction_from_sums(shifted.sum(), (shifted * shifted).sum(), int(valid.sum()))
    scale = frac.sqrt().clamp(min=min_scale, max=1.0).float()
    return scale, {"vcpo/ess_frac": metric(frac), "vcpo/lr_scale": metric(scale)}


def ess_scaled_lr(lr: float, scale: torch.Tensor | float) -> float:
    """The optimizer step's learning rate: the schedule's ``lr`` times the VCPO multiplier."""
    s = float(scale)
    if not (0 < s <= 1) or math.isnan(s):
        raise ValueError(f"ESS lr scale: expected a number in (0, 1], got {s}")
    return lr * s
