"""Issue 11 item 8: the algorithm fixes, each checked against an independent expectation.

Every test here fails on the code before the fix (CISPO lower clip unreachable from the
config, 0.0 clip_high treated as unset, GSPO's sequence form weighting every token's gradient
by the sequence's mean IS weight, the two GSPO forms disagreeing beyond |mean log ρ| > 20,
``loss.norm_len`` not wired).
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import GSPOParams, LossInputs, compute_policy_loss, gspo_loss, gspo_token_loss
from moe_rl.config import CorrectionConfig, LossConfig

F64 = torch.float64


def _one_row(ratios, device, adv=1.0):
    old = torch.full((1, len(ratios)), math.log(0.3), dtype=F64, device=device)
    logp = (old + torch.tensor([[math.log(r) for r in ratios]], dtype=F64, device=device)).requires_grad_(True)
    mask = torch.ones_like(old, dtype=torch.bool)
    return logp, old, mask, torch.full((1,), adv, dtype=F64, device=device)


def test_cispo_lower_clip_reaches_the_loss_from_the_config(device):
    # r = 0.5 and 1.0, A = 1, ε_low = 0.2 → weights sg[clip(r, 0.8, 1.2)] = 0.8, 1.0
    logp, old, mask, adv = _one_row([0.5, 1.0], device)
    cfg = LossConfig(type="cispo", cispo_clip_low=0.2, clip_high=0.2)
    loss, m = compute_policy_loss(cfg, CorrectionConfig(), logp, old, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-0.8, -1.0]], dtype=F64, device=device) / 2)
    assert m["loss/clip_frac"].item() == pytest.approx(0.5)


def test_cispo_clip_high_zero_is_a_bound_not_unset(device):
    # cispo_clip_high = 0 → weight min(r, 1): r = 1.5 gives 1.0, not 1 + clip_high = 1.28
    logp, old, mask, adv = _one_row([1.5], device)
    cfg = LossConfig(type="cispo", cispo_clip_high=0.0)
    loss, _ = compute_policy_loss(cfg, CorrectionConfig(), logp, old, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-1.0]], dtype=F64, device=device))


def _gspo_batch(device, shift=0.0):
    g = torch.Generator().manual_seed(5)
    b, t = 4, 6
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 2
    lp = old + 0.05 * torch.randn(b, t, generator=g, dtype=F64) + shift
    adv = torch.randn(b, generator=g, dtype=F64)
    w = torch.rand(b, t, generator=g, dtype=F64) * 2
    return [x.to(device) for x in (lp, old, adv, mask, w)]


def _loss_and_grad(lp0, old, adv, mask, w, token_level):
    lp = lp0.clone().requires_grad_(True)
    fn = gspo_token_loss if token_level else gspo_loss
    loss, _ = fn(LossInputs(lp, old, adv, mask, is_weights=w), GSPOParams(clip_low=0.02, clip_high=0.02))
    return loss.detach(), torch.autograd.grad(loss, lp)[0]


def test_gspo_sequence_form_weights_each_token_gradient_by_its_own_is_weight(device):
    lp, old, adv, mask, w = _gspo_batch(device)
    loss_seq, grad_seq = _loss_and_grad(lp, old, adv, mask, w, token_level=False)
    loss_tok, grad_tok = _loss_and_grad(lp, old, adv, mask, w, token_level=True)
    torch.testing.assert_close(loss_seq, loss_tok)
    torch.testing.assert_close(grad_seq, grad_tok)
    # independent formula: the value is mean_i w̄_i ℓ_i (ℓ_i = max(−A s, −A clip(s))); the
    # gradient is (1/B) w_t · dℓ_i/dlog s_i · (1/|y_i|) — w_t in place of w̄_i, one 1/|y_i| from
    # d log s_i / d log π_θ(y_t).
    n = mask.sum(1).to(F64)
    log_s = torch.where(mask, lp - old, 0).sum(1) / n
    s = log_s.exp()
    unclipped = (-adv * s) >= (-adv * s.clamp(0.98, 1.02))
    dl_dlogs = torch.where(unclipped, -adv * s, torch.zeros_like(s))
    expected = torch.where(mask, w * (dl_dlogs / n)[:, None], 0) / mask.shape[0]
    torch.testing.assert_close(grad_seq, expected)


@pytest.mark.parametrize("shift", [30.0, -30.0])
def test_gspo_forms_agree_beyond_the_log_ratio_bound(device, shift):
    lp, old, adv, mask, w = _gspo_batch(device, shift)
    for weights in (None, w):
        loss_seq, grad_seq = _loss_and_grad(lp, old, adv, mask, weights, token_level=False)
        loss_tok, grad_tok = _loss_and_grad(lp, old, adv, mask, weights, token_level=True)
        torch.testing.assert_close(loss_seq, loss_tok)
        assert torch.count_nonzero(grad_seq) == 0 and torch.count_nonzero(grad_tok) == 0  # clamped: no gradient


def test_norm_len_is_the_seq_mean_token_sum_norm_divisor(device):
    logp, old, mask, adv = _one_row([1.0, 1.0, 1.0], device)
    # REINFORCE on one row of three tokens, logp = log 0.3: Σ −A·logp = −3 log 0.3
    cfg = LossConfig(type="reinforce", aggregation="seq_mean_token_sum_norm", norm_len=10)
    loss, _ = compute_policy_loss(cfg, CorrectionConfig(), logp, old, old, adv, mask)
    assert loss.item() == pytest.approx(-3 * math.log(0.3) / (1 * 10))
    padded = LossConfig(type="reinforce", aggregation="seq_mean_token_sum_norm")
    loss_t, _ = compute_policy_loss(padded, CorrectionConfig(), logp, old, old, adv, mask)
    assert loss_t.item() == pytest.approx(-3 * math.log(0.3) / 3)  # default: the padded T


def test_scale_factor_multiplies_the_total(device):
    logp, old, mask, adv = _one_row([1.0, 2.0], device)
    base, _ = compute_policy_loss(LossConfig(), CorrectionConfig(), logp, old, old, adv, mask)
    scaled, m = compute_policy_loss(LossConfig(scale_factor=0.25), CorrectionConfig(), logp, old, old, adv, mask)
    assert scaled.item() == pytest.approx(0.25 * base.item())
    assert m["loss/total"].item() == pytest.approx(0.25 * base.item())
