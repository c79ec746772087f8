"""M2PO, VCPO's ESS step size, chained rejection and sequence-level IcePop against independent
formulas (brute force / per-element loops) on random tensors with edge cases."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from moe_rl.algo import (
    chained_rejection_mask,
    compute_policy_loss,
    ess_lr_scale,
    m2po_mask,
    prepare_corrections,
    rejection_mask,
    sequence_icepop_weights,
)
from moe_rl.config import CorrectionConfig, LossConfig
from moe_rl.config.loader import apply_overrides

F64 = torch.float64


def _batch(device, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 7
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 1:] = False  # length 1
    mask[2] = False  # all masked
    mask[4, 5:] = False
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.1
    roll = old + scale * torch.randn(b, t, generator=g, dtype=F64)
    old[3, 2], roll[3, 2] = -1.0, -31.0  # log ρ = +30
    old[5, 0], roll[5, 0] = -31.0, -1.0  # log ρ = −30
    return [x.to(device) for x in (old, roll, mask)]


def _brute_force_m2po(lr, mask, tau):
    """Remove the largest (log ρ)² one at a time until the kept mean is ≤ τ."""
    items = sorted(
        ((lr[i, j].item() ** 2, i * mask.shape[1] + j) for i, j in mask.nonzero().tolist()), key=lambda v: v[0]
    )
    while items and sum(v for v, _ in items) / len(items) > tau:
        items.pop()
    return {k for _, k in items}


@pytest.mark.parametrize("tau", [0.04, 0.5, 1e-6])
def test_m2po_matches_brute_force(device, tau):
    old, roll, mask = _batch(device)
    keep, m = m2po_mask(old, roll, mask, tau)
    expected = _brute_force_m2po(old - roll, mask, tau)
    assert set(keep.reshape(-1).nonzero().squeeze(1).tolist()) == expected
    kept_sq = ((old - roll) ** 2)[keep]
    assert kept_sq.numel() == 0 or kept_sq.mean().item() <= tau + 1e-12
    assert m["m2po/masked_frac"].item() == pytest.approx(1 - len(expected) / int(mask.sum()))


def test_m2po_hand_worked(device):
    # (log ρ)² = 0.01, 0.04, 0.09, 1.0 → prefix means 0.01, 0.025, 0.0467, 0.285; τ = 0.04 keeps two
    lr = torch.tensor([[0.1, -0.2, 0.3, 1.0]], dtype=F64, device=device)
    keep, _ = m2po_mask(lr, torch.zeros_like(lr), torch.ones_like(lr, dtype=torch.bool), 0.04)
    assert keep.tolist() == [[True, True, False, False]]


def test_m2po_in_prepare_corrections_measures_the_behaviour_ratio(device):
    # Seed 000: E[(log ρ)²] ≤ τ with ρ to the behaviour policy μ; AReaL's M2PO masks on the behaviour
    # vs proximal log-probs. Decoupled: π_old/μ (no π_θ needed); bypass: sg[π_θ]/μ (the pre-pass).
    old, roll, mask = _batch(device, seed=1)
    policy = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=F64).to(device)
    for mode, source in (("decoupled", old), ("bypass", policy)):
        cfg = CorrectionConfig(mode=mode, m2po_tau=0.04)
        prep = prepare_corrections(LossConfig(), cfg, source, roll, mask, policy_logp=policy)
        torch.testing.assert_close(prep.keep, _brute_force_keep(source - roll, mask, 0.04))
    # the first minibatch of a step (π_θ = π_old) still masks when the engines disagree
    prep = prepare_corrections(LossConfig(), CorrectionConfig(m2po_tau=0.04), old, roll, mask, policy_logp=old)
    assert prep.metrics["m2po/masked_frac"].item() > 0.2 and prep.metrics["m2po/m2_before"].item() > 0.04


def _brute_force_keep(lr, mask, tau):
    keep = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    keep[sorted(_brute_force_m2po(lr, mask, tau))] = True
    return keep.view_as(mask)


def test_m2po_budget_is_over_the_tokens_that_survive_rejection(device):
    # sequence 0: log ρ = [0, 0, -2.5] (vetoed at 1e-1: its two on-policy tokens leave the loss too);
    # sequence 1: log ρ = [.245] x 3, (log ρ)² = .06 > τ. Budgeted before the veto, the two zeros
    # would pull the mean under τ and keep sequence 1 (mean .06 entering the loss).
    lr = torch.tensor([[0.0, 0.0, -2.5], [0.245, 0.245, 0.245]], dtype=F64, device=device)
    roll = torch.full_like(lr, -1.0)
    mask = torch.ones_like(lr, dtype=torch.bool)
    cfg = CorrectionConfig(m2po_tau=0.04, token_veto_threshold=0.1)
    prep = prepare_corrections(LossConfig(), cfg, roll + lr, roll, mask)
    assert not bool(prep.keep.any()), prep.keep
    assert prep.metrics["m2po/m2_before"].item() == pytest.approx(0.245**2)
    assert prep.metrics["m2po/m2_after"].item() == 0.0
    # with a looser budget the kept tokens' mean is what m2_after reports
    prep = prepare_corrections(
        LossConfig(), CorrectionConfig(m2po_tau=0.07, token_veto_threshold=0.1), roll + lr, roll, mask
    )
    assert prep.keep.tolist() == [[False] * 3, [True] * 3]
    assert prep.metrics["m2po/m2_after"].item() == pytest.approx(0.245**2)


def test_ess_lr_scale_independent_formula(device):
    lw = torch.tensor([0.0, 0.5, -1.0, 30.0, -30.0, 2.0], dtype=F64, device=device)
    scale, m = ess_lr_scale(lw, min_scale=0.01)
    w = [math.exp(x - 30.0) for x in lw.tolist()]
    ess = sum(w) ** 2 / (len(w) * sum(x * x for x in w))
    assert m["vcpo/ess_frac"].item() == pytest.approx(ess)
    assert scale.item() == pytest.approx(max(0.01, math.sqrt(ess)), rel=1e-6)
    equal, _ = ess_lr_scale(torch.full((4,), 3.0, dtype=F64, device=device))
    assert equal.item() == pytest.approx(1.0)  # equal weights: full step
    floor, _ = ess_lr_scale(torch.tensor([0.0, -50.0, -50.0, -50.0], dtype=F64, device=device), min_scale=0.7)
    assert floor.item() == pytest.approx(0.7)  # sqrt(1/4) = 0.5 clamped to 0.7


def test_chained_rejection_is_the_and_of_single_criteria(device):
    old, roll, mask = _batch(device, seed=2)
    criteria = [{"mode": "seq_mean_k3", "upper": 0.05}, {"mode": "token_k1", "lower": 0.5, "upper": 2.0}]
    keep, m = chained_rejection_mask(old, roll, mask, criteria)
    k1, m1 = rejection_mask(old, roll, mask, "seq_mean_k3", None, 0.05)
    k2, m2 = rejection_mask(old, roll, mask, "token_k1", 0.5, 2.0)
    torch.testing.assert_close(keep, k1 & k2)
    assert m["rs/0_seq_mean_k3/masked_frac"].item() == pytest.approx(m1["rs/masked_frac"].item())
    assert m["rs/1_token_k1/masked_frac"].item() == pytest.approx(m2["rs/masked_frac"].item())
    # independent token_k1: keep iff 0.5 ≤ π_old/μ ≤ 2 per token
    lr = (old - roll).tolist()
    for i, j in mask.nonzero().tolist():
        assert bool(k2[i, j]) == (0.5 <= math.exp(lr[i][j]) <= 2.0)


def test_rejection_list_parses_from_the_command_line_and_drives_the_loss(device):
    tree = apply_overrides(
        {}, ["correction.rejection=[{mode: seq_mean_k3, upper: 0.01}, {mode: token_k1, lower: 0.5, upper: 2.0}]"]
    )
    cfg = CorrectionConfig(**tree["correction"])
    assert [c.mode for c in cfg.rejection] == ["seq_mean_k3", "token_k1"]
    old, roll, mask = _batch(device, seed=3)
    logp = old.clone().requires_grad_(True)
    _, m = compute_policy_loss(LossConfig(), cfg, logp, old, roll, torch.ones(6, dtype=F64, device=device), mask)
    keep, _ = chained_rejection_mask(old, roll, mask, cfg.rejection)
    assert m["correction/kept_token_frac"].item() == pytest.approx(keep.sum().item() / mask.sum().item())
    with pytest.raises(ValueError, match="lower"):
        CorrectionConfig(rejection=[{"mode": "token_k1", "upper": 2.0}])
    with pytest.raises(ValueError, match="both set"):
        CorrectionConfig(rs_mode="token_k2", rs_upper=1.0, rejection=[{"mode": "token_k2", "upper": 1.0}])


@pytest.mark.parametrize("geometric", [False, True])
def test_sequence_icepop_independent_formula(device, geometric):
    old, roll, mask = _batch(device, seed=4, scale=0.2)
    w, m = sequence_icepop_weights(old, roll, mask, 0.5, 2.0, weighted=True, geometric=geometric)
    n_seq_out = 0
    for i in range(mask.shape[0]):
        lrs = [old[i, j].item() - roll[i, j].item() for j in range(mask.shape[1]) if mask[i, j]]
        if not lrs:
            assert torch.count_nonzero(w[i]) == 0
            continue
        log_k = sum(lrs) / len(lrs) if geometric else sum(lrs)
        inside = math.log(0.5) <= log_k <= math.log(2.0)
        n_seq_out += not inside
        expected = math.exp(max(-20, min(20, log_k))) if inside else 0.0
        for j in range(mask.shape[1]):
            assert w[i, j].item() == pytest.approx(expected if mask[i, j] else 0.0)
    assert m["icepop/seq_masked_frac"].item() == pytest.approx(n_seq_out / 5)


def test_sequence_icepop_wired_through_the_config(device):
    old, roll, mask = _batch(device, seed=5, scale=0.1)
    cfg = SimpleNamespace(**CorrectionConfig(icepop=True, icepop_level="sequence").model_dump())
    prep = prepare_corrections(LossConfig(), cfg, old, roll, mask)
    w, _ = sequence_icepop_weights(old, roll, mask, 0.5, 5.0, weighted=True)
    torch.testing.assert_close(prep.weights, w)
