"""Degenerate inputs for the verl-named estimators and the GPG loss: finite values, never an exception.

Cases (issue 54, "the M2PO lesson"): every token masked (responses of length 0), one token, constant
rewards, and ±30 log-ratios — IS weights exp(±30) where an input is a ratio (OTB's ρ̄_t, the GPG loss's
w_t), π_old log-probs of −30 (π_t ≈ 1e-13), and rewards of ±30 for the estimators that read no ratio.
Each estimator also runs through ``compute_advantages`` with the config's defaults.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import LossInputs, compute_advantages, surrogate_loss
from moe_rl.config import AdvantageConfig, LossConfig

GROUP = 3


def _case(name: str, device):
    """(rewards[B], mask[B, T], old_logp, sum_pi_squared, token IS weights) for degenerate case ``name``."""
    b, t = 6, 4
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.bool)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64)
    w = torch.ones(b, t, dtype=torch.float64)
    if name == "all_masked":
        mask[:] = False
        old[:] = torch.nan  # padding may hold anything
    elif name == "one_token":
        mask[:] = False
        mask[0, 0] = True
    elif name == "constant_rewards":
        rewards[:] = 1.0
    elif name == "extreme":
        rewards = torch.tensor([30.0, -30.0, 30.0, -30.0, 30.0, -30.0], dtype=torch.float64)
        old[:] = -30.0
        w = torch.exp(torch.tensor([30.0, -30.0], dtype=torch.float64)).repeat(b * t // 2).view(b, t)
    p = old.nan_to_num().exp()
    spp = p**2 + (1 - p) ** 2 * 0.5
    return [x.to(device) for x in (rewards, mask, old, spp, w)]


CASES = ["all_masked", "one_token", "constant_rewards", "extreme"]
ESTIMATORS = ["gpg", "grpo_passk", "gdpo", "remax", "optimal_token_baseline", "tir_optimal_token_baseline"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_estimator_is_finite_on_degenerate_inputs(estimator, case, device):
    rewards, mask, old, spp, w = _case(case, device)
    adv = compute_advantages(
        AdvantageConfig(estimator=estimator),
        rewards,
        GROUP,
        lengths=mask.sum(1),
        reward_baselines=rewards.flip(0),
        mask=mask,
        old_logp=old,
        sum_pi_squared=spp,
        token_is_weights=w,
    )
    assert adv.shape[0] == rewards.shape[0] and bool(torch.isfinite(adv).all()), (estimator, case, adv)
    if adv.dim() == 2:  # token baselines: nothing outside the mask
        assert bool((adv[~mask] == 0).all())
    if case == "constant_rewards" and estimator != "remax":  # no response is better than its group
        assert float(adv.abs().max()) < 1e-6


@pytest.mark.parametrize("case", CASES)
def test_gpg_loss_is_finite_on_degenerate_inputs(case, device):
    rewards, mask, old, _, w = _case(case, device)
    logp = old.nan_to_num().clone().requires_grad_(True)
    x = LossInputs(logp, None, rewards, mask, w)
    loss, metrics = surrogate_loss(LossConfig(type="gpg"), x)
    (grad,) = torch.autograd.grad(loss, logp)
    assert math.isfinite(float(loss.detach())) and bool(torch.isfinite(grad).all())
    assert all(math.isfinite(float(v)) for v in metrics.values())
    if case == "all_masked":
        assert float(loss.detach()) == 0.0 and bool((grad == 0).all())
