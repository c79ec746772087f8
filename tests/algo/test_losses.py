"""Golden values, gradients and gradchecks for PPO-clip, GSPO(-token), CISPO, REINFORCE and aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import (
    CISPOParams,
    GSPOParams,
    LossInputs,
    PPOClipParams,
    aggregate,
    cispo_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
    reinforce_loss,
)

F64 = torch.float64


def ratios_to_logp(ratios, old=None):
    """(logp with grad, old_logp, mask) for one row whose ratios π_θ/π_old are given."""
    old = torch.full((1, len(ratios)), math.log(0.4), dtype=F64) if old is None else old
    logp = (old + torch.tensor([[math.log(r) for r in ratios]], dtype=F64)).requires_grad_(True)
    return logp, old, torch.ones_like(old, dtype=torch.bool)


def test_aggregations_hand_worked():
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq_mean_token_sum_norm").item() == pytest.approx(10 / (2 * 4))
    assert aggregate(loss, mask, "seq_mean_token_sum_norm", norm_len=2).item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "token_mean", denominator=20).item() == pytest.approx(0.5)


def test_seq_mean_token_mean_skips_fully_masked_rows():
    loss = torch.tensor([[1.0, 2.0], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx(1.5)


def test_ppo_clip_asymmetric_and_dual_clip_hand_worked():
    # r = 0.5, 1, 1.5 (A=+1); 0.5, 1.5, 5 (A=−1); ε_low 0.2, ε_high 0.28 → clip to [0.8, 1.28]
    # per-token max(−A r, −A clip r): −0.5, −1, −1.28, 0.8, 1.5, 5 (dual clip c=3 → 3)
    logp, old, mask = ratios_to_logp([0.5, 1.0, 1.5, 0.5, 1.5, 5.0])
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]], dtype=F64)
    loss, m = ppo_clip_loss(LossInputs(logp, old, adv, mask), PPOClipParams(clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx((-0.5 - 1 - 1.28 + 0.8 + 1.5 + 5.0) / 6)
    assert m["loss/clip_frac"].item() == pytest.approx(2 / 6)
    assert m["loss/clip_frac_low"].item() == pytest.approx(1 / 6)
    assert m["loss/clip_frac_high"].item() == pytest.approx(1 / 6)
    loss_d, m_d = ppo_clip_loss(LossInputs(logp, old, adv, mask), PPOClipParams(0.2, 0.28, dual_clip_c=3.0))
    assert loss_d.item() == pytest.approx((-0.5 - 1 - 1.28 + 0.8 + 1.5 + 3.0) / 6)
    assert m_d["loss/dual_clip_frac"].item() == pytest.approx(1 / 6)
    (grad,) = torch.autograd.grad(loss_d, logp)
    # d/dlogp of −A·r is −A·r where the unclipped branch is active, 0 where clipped or floored
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -1.0, 0.0, 0.0, 1.5, 0.0]], dtype=F64) / 6)


def test_ppo_is_weights_multiply_each_token_term():
    logp, old, mask = ratios_to_logp([1.0, 1.0])
    adv = torch.tensor([[1.0, 2.0]], dtype=F64)
    w = torch.tensor([[0.5, 2.0]], dtype=F64)
    loss, _ = ppo_clip_loss(LossInputs(logp, old, adv, mask, is_weights=w))
    assert loss.item() == pytest.approx((-1.0 * 0.5 - 2.0 * 2.0) / 2)


@pytest.mark.parametrize("r", [0.9998, 1.0002, 1.01, 0.5])
def test_gspo_constant_token_ratio_gives_s_equal_r_for_every_length(r):
    lengths, t = [1, 3, 7], 7
    mask = torch.tensor([[j < n for j in range(t)] for n in lengths])
    old = -torch.rand(3, t, dtype=F64) - 0.1
    logp = old + math.log(r)
    logp[~mask] = -50.0  # padding garbage must not leak into s_i
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=F64)
    loss, m = gspo_loss(LossInputs(logp, old, adv, mask))
    assert m["loss/seq_ratio_min"].item() == pytest.approx(r, rel=1e-6)
    assert m["loss/seq_ratio_max"].item() == pytest.approx(r, rel=1e-6)
    lo, hi = 1 - 3e-4, 1 + 4e-4
    expected = sum(max(-a * r, -a * min(max(r, lo), hi)) for a in (1.0, -1.0, 2.0)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-9)


def test_on_policy_gspo_and_ppo_gradients_equal_plain_policy_gradient():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    old = -torch.rand(3, 4, dtype=F64)
    adv = torch.tensor([0.7, -1.3, 0.4], dtype=F64)
    n = mask.sum(dim=1, keepdim=True).to(F64)
    # ∇ of −mean_i mean_t A_i log π_t is −A_i / (N_seq · |y_i|); token-mean: −A_i / N_tok
    pg_seq = torch.where(mask, -adv[:, None] / (3 * n), torch.zeros((), dtype=F64))
    pg_tok = torch.where(mask, -adv[:, None] / mask.sum(), torch.zeros((), dtype=F64))
    cases = [
        (lambda lp: gspo_loss(LossInputs(lp, old, adv, mask)), pg_seq),
        (lambda lp: gspo_token_loss(LossInputs(lp, old, adv, mask)), pg_seq),
        (lambda lp: ppo_clip_loss(LossInputs(lp, old, adv, mask, aggregation="seq_mean_token_mean")), pg_seq),
        (lambda lp: ppo_clip_loss(LossInputs(lp, old, adv, mask), PPOClipParams(dual_clip_c=3.0)), pg_tok),
        (lambda lp: cispo_loss(LossInputs(lp, old, adv, mask)), pg_tok),
        (lambda lp: reinforce_loss(LossInputs(lp, None, adv, mask)), pg_tok),
    ]
    for fn, expected in cases:
        logp = old.clone().requires_grad_(True)
        loss, m = fn(logp)
        (grad,) = torch.autograd.grad(loss, logp)
        torch.testing.assert_close(grad, expected)
        assert m.get("loss/clip_frac", torch.tensor(0.0)).item() == 0.0


def test_gspo_token_equals_gspo_with_sequence_constant_advantages():
    torch.manual_seed(1)
    mask = torch.rand(6, 9) < 0.8
    mask[:, 0] = True
    old = -torch.rand(6, 9, dtype=F64) * 3
    logp0 = old + 0.002 * torch.randn(6, 9, dtype=F64)  # some sequences inside the clip band, some outside
    adv = torch.randn(6, dtype=F64)
    grads, losses = [], []
    for token_level in (False, True):
        logp = logp0.clone().requires_grad_(True)
        fn = gspo_token_loss if token_level else gspo_loss
        loss, _ = fn(LossInputs(logp, old, adv, mask), GSPOParams(clip_low=3e-4, clip_high=4e-4))
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, logp)[0])
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(grads[0], grads[1])


def test_gspo_sequence_gradient_is_s_times_mean_token_score():
    # ∇_{logp_t} s_i = s_i / |y_i| inside the band; loss = −A s_i (one sequence)
    logp, old, mask = ratios_to_logp([1.0001, 1.0001, 1.0001, 1.0004])
    s = math.exp((3 * math.log(1.0001) + math.log(1.0004)) / 4)
    loss, _ = gspo_loss(LossInputs(logp, old, torch.tensor([2.0], dtype=F64), mask))
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-2.0 * s)
    torch.testing.assert_close(grad, torch.full((1, 4), -2.0 * s / 4, dtype=F64))


def test_cispo_clips_a_stop_gradient_weight_only():
    logp, old, mask = ratios_to_logp([0.5, 1.0, 1.5])
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=F64)
    loss, m = cispo_loss(LossInputs(logp, old, adv, mask), CISPOParams(cispo_clip_low=None, clip_high=0.2))
    # weights sg[clip(r)] = 0.5, 1.0, 1.2 (no lower bound); ∇ = −w·A / N
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -1.0, 1.2]], dtype=F64) / 3)
    lp = logp.detach()[0]
    assert loss.item() == pytest.approx(-(0.5 * lp[0] + 1.0 * lp[1] - 1.2 * lp[2]).item() / 3)
    assert m["loss/clip_frac"].item() == pytest.approx(1 / 3)


def test_reinforce_applies_is_weights():
    logp = torch.log(torch.tensor([[0.5, 0.25]], dtype=F64)).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    w = torch.tensor([[1.0, 0.5]], dtype=F64)
    loss, _ = reinforce_loss(LossInputs(logp, None, torch.tensor([2.0], dtype=F64), mask, is_weights=w))
    assert loss.item() == pytest.approx(-(2 * math.log(0.5) + 2 * 0.5 * math.log(0.25)) / 2)


@pytest.mark.parametrize(
    "name",
    ["ppo", "ppo_dual_seq", "gspo", "gspo_token", "cispo", "reinforce", "ppo_sum_norm"],
)
def test_gradcheck_float64(name):
    torch.manual_seed(2)
    b, t = 3, 5
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    old = -torch.rand(b, t, dtype=F64) * 2
    adv = torch.randn(b, t, dtype=F64)
    w = torch.rand(b, t, dtype=F64) + 0.5
    lp0 = old + 0.6 * torch.randn(b, t, dtype=F64)
    cispo = CISPOParams(cispo_clip_low=0.2, clip_high=0.2)
    seq, sum_norm, dual = "seq_mean_token_mean", "seq_mean_token_sum_norm", PPOClipParams(dual_clip_c=2.0)
    fns = {
        "ppo": lambda lp: ppo_clip_loss(LossInputs(lp, old, adv, mask, is_weights=w))[0],
        "ppo_dual_seq": lambda lp: ppo_clip_loss(LossInputs(lp, old, adv, mask, aggregation=seq), dual)[0],
        "ppo_sum_norm": lambda lp: ppo_clip_loss(LossInputs(lp, old, adv, mask, aggregation=sum_norm))[0],
        # With token IS weights GSPO's gradient is deliberately Σ_t w_t-weighted (issue 11), not
        # the derivative of its value w̄_i·ℓ_i; the unweighted sequence loss is checked here and
        # the weighted one against GSPO-token in test_algo_fixes.py.
        "gspo": lambda lp: gspo_loss(LossInputs(lp, old, adv, mask), GSPOParams(0.2, 0.2))[0],
        # GSPO-token's stop-gradients make its gradient the true one only for sequence-constant
        # advantages (GSPO paper §4.3); that is the case checked here.
        "gspo_token": lambda lp: gspo_token_loss(LossInputs(lp, old, adv[:, 0], mask), GSPOParams(0.2, 0.2))[0],
        # CISPO's weight is sg[clip(r)]: shift old_logp with logp so r (hence the weight) is held
        # fixed under finite differences, and check ∇ = −w·A exactly as defined.
        "cispo": lambda lp: cispo_loss(LossInputs(lp, old + (lp - lp0), adv, mask, is_weights=w), cispo)[0],
        "reinforce": lambda lp: reinforce_loss(LossInputs(lp, None, adv, mask, is_weights=w))[0],
    }
    # ratios spread over both sides of the clip range, away from the kinks
    logp = lp0.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(fns[name], (logp,), eps=1e-6, atol=1e-7)


def test_bfloat16_inputs_are_upcast_and_gradient_reaches_the_leaf():
    torch.manual_seed(3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    old = -torch.rand(2, 3)
    logp = (old + 0.01).to(torch.bfloat16).requires_grad_(True)
    loss, _ = ppo_clip_loss(LossInputs(logp, old.to(torch.bfloat16), torch.tensor([1.0, -1.0]), mask))
    assert loss.dtype == torch.float32
    loss.backward()
    assert logp.grad is not None and logp.grad.dtype == torch.bfloat16
