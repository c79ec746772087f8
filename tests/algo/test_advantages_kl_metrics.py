"""Hand-worked values for GRPO / RLOO advantages, KL estimators and the off-policy diagnostics."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from moe_rl.algo import (
    broadcast_to_tokens,
    compute_advantages,
    grpo_advantages,
    kl_penalty,
    offpolicy_metrics,
    rloo_advantages,
)

F64 = torch.float64


def test_grpo_with_and_without_std_hand_worked():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # group 1: mean 0.5, unbiased std sqrt(1/3) → ±0.5·sqrt(3) = ±0.8660; group 2 constant → 0
    adv = grpo_advantages(rewards, group_size=4, eps=1e-12)
    s = 0.5 * math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([s, -s, -s, s, 0, 0, 0, 0], dtype=torch.float32))
    adv_ns = grpo_advantages(rewards, group_size=4, normalize_std=False)
    torch.testing.assert_close(adv_ns, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_rloo_is_reward_minus_mean_of_the_others():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 5.0])
    # 1 − mean(0,0,1) = 2/3; 0 − mean(1,0,1) = −2/3; group 2 (G=2): 3−5, 5−3
    adv = rloo_advantages(rewards, group_size=2)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, -2.0, 2.0]))
    adv4 = rloo_advantages(rewards[:4], group_size=4)
    torch.testing.assert_close(adv4, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_compute_advantages_follows_the_config_section():
    rewards = torch.tensor([1.0, 0.0, 3.0, 5.0])

    def cfg(name):
        return SimpleNamespace(estimator=name, eps=1e-6)

    assert compute_advantages(cfg("rloo"), rewards, 2).tolist() == [1.0, -1.0, -2.0, 2.0]
    assert compute_advantages(cfg("grpo_no_std"), rewards, 2).tolist() == [0.5, -0.5, -1.0, 1.0]
    with pytest.raises(ValueError, match="advantage.estimator"):
        compute_advantages(SimpleNamespace(estimator="gae", eps=1e-6), rewards, 2)


def test_advantage_errors():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.ones(6), group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(torch.ones(4), group_size=0)
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(torch.ones(2, 2), group_size=2)
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), group_size=2)


def test_broadcast_to_tokens_zeroes_padding():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask).tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


def test_kl_estimators_hand_worked_values_and_k3_plus_gradient():
    # π_θ = 0.5, π_ref = 0.25: d = log π_θ − log π_ref = ln 2
    logp = torch.log(torch.tensor([[0.5]], dtype=F64)).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25]], dtype=F64))
    ln2 = math.log(2)
    expected = {"k1": ln2, "k2": 0.5 * ln2**2, "k3": 0.5 + ln2 - 1, "k3_plus": 0.5 + ln2 - 1}
    # gradients wrt log π_θ: k1 → 1, k2 → d, k3 → 1 − π_ref/π_θ = 0.5, k3+ → k2's gradient d
    expected_grad = {"k1": 1.0, "k2": ln2, "k3": 0.5, "k3_plus": ln2}
    for est, value in expected.items():
        kl = kl_penalty(logp, ref, est)
        assert kl.item() == pytest.approx(value), est
        (g,) = torch.autograd.grad(kl.sum(), logp)
        assert g.item() == pytest.approx(expected_grad[est]), est
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "k4")


def _constant_ratio_batch():
    # μ = 0.25 everywhere, π_old = 0.5 → ρ = 2 on valid tokens; lengths 2 and 3
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    roll = torch.full((2, 3), math.log(0.25), dtype=F64)
    old = torch.full((2, 3), math.log(0.5), dtype=F64)
    old[0, 2] = float("nan")  # padding may hold anything
    return old, roll, mask


def test_offpolicy_metrics_hand_worked_constant_ratio():
    m = offpolicy_metrics(*_constant_ratio_batch())
    v = {k.split("/", 1)[1]: t.item() for k, t in m.items()}
    ln2 = math.log(2)
    assert v["kl_k1"] == pytest.approx(-ln2)
    assert v["kl_k3"] == pytest.approx(2 - ln2 - 1)
    assert v["chi2_token"] == pytest.approx(0.0, abs=1e-7)  # all weights equal
    assert v["ess"] == pytest.approx(1.0)
    assert v["chi2_token_raw"] == pytest.approx(2**2 - 1)
    # sequence ratios 4 and 8: mean(w²)/mean(w)² − 1 = 40/36 − 1; raw = 40 − 1
    assert v["chi2_seq"] == pytest.approx(40 / 36 - 1)
    assert v["ess_seq"] == pytest.approx(36 / 40)
    assert v["chi2_seq_raw"] == pytest.approx(39.0)
    assert v["ppl_old"] == pytest.approx(2.0)
    assert v["ppl_rollout"] == pytest.approx(4.0)
    assert v["ppl_ratio"] == pytest.approx(0.5)
    assert v["prob_abs_diff_mean"] == pytest.approx(0.25)
    assert v["prob_abs_diff_max"] == pytest.approx(0.25)
    assert v["tv"] == pytest.approx(0.5)
    assert v["log_ratio_abs_max"] == pytest.approx(ln2)
    assert v["prob_pearson"] == 0.0  # constant, different probabilities: no agreement


def test_offpolicy_metrics_has_every_documented_key():
    keys = set(offpolicy_metrics(*_constant_ratio_batch()))
    required = {
        "kl_k1",
        "kl_k3",
        "chi2_token",
        "chi2_seq",
        "ess",
        "ppl_old",
        "ppl_rollout",
        "ppl_ratio",
        "prob_pearson",
        "prob_abs_diff_mean",
        "prob_abs_diff_max",
    }
    assert {f"offpolicy/{k}" for k in required} <= keys


def test_prob_pearson_is_plus_and_minus_one_for_linear_relations():
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.log(torch.tensor([[0.1, 0.2, 0.3]], dtype=F64))
    up = torch.log(torch.tensor([[0.2, 0.4, 0.6]], dtype=F64))
    down = torch.log(torch.tensor([[0.3, 0.2, 0.1]], dtype=F64))
    assert offpolicy_metrics(old, up, mask)["offpolicy/prob_pearson"].item() == pytest.approx(1.0)
    assert offpolicy_metrics(old, down, mask)["offpolicy/prob_pearson"].item() == pytest.approx(-1.0)
    assert offpolicy_metrics(old, old, mask)["offpolicy/prob_pearson"].item() == pytest.approx(1.0)


def test_identical_policies_give_zero_divergence_and_unit_ess():
    torch.manual_seed(0)
    lp = -torch.rand(4, 7, dtype=F64) * 5
    mask = torch.rand(4, 7) < 0.7
    mask[:, 0] = True
    v = offpolicy_metrics(lp, lp, mask)
    for k in ("kl_k1", "kl_k3", "chi2_token", "chi2_seq", "chi2_token_raw", "prob_abs_diff_max", "tv"):
        assert v[f"offpolicy/{k}"].item() == pytest.approx(0.0, abs=1e-7), k
    assert v["offpolicy/ess"].item() == pytest.approx(1.0)
    assert v["offpolicy/ppl_ratio"].item() == pytest.approx(1.0)
