"""verl 0.9.1's estimators and GPG loss we port, against verl's own functions (issue 54, first slice).

Each test runs verl's function from the pinned wheel (fixture ``verl091``, tests/algo/verl_wheel.py) and
ours on the same ragged batch — several groups of unequal sizes, responses of unequal lengths — and
asserts equality to 1e-6 relative. verl's estimators take token-level rewards: the outcome reward sits
on each response's last token (as verl's reward managers put it), so its reward-to-go is r on every
response token and our ``adv[B]`` broadcast to the tokens is the comparable form. Singleton groups are
left out of the equality cases (ours 0, verl's the raw reward: docs/algo.md) and shown apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_rl.algo import (
    LossInputs,
    broadcast_to_tokens,
    compute_advantages,
    gdpo_advantages,
    get_policy_loss_fn,
    gpg_advantages,
    grpo_passk_advantages,
    optimal_token_baseline_advantages,
    remax_advantages,
    surrogate_loss,
)
from moe_rl.config import AdvantageConfig, LossConfig

IDS = [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3]  # four groups: sizes 3, 4, 2, 3
# response lengths: group 0 has a unique longest (7 > 5: OTB's zero tail), group 1 a tie for longest
LENGTHS = [2, 5, 7, 4, 6, 6, 1, 3, 3, 5, 2, 6]
T = 8


def _close(a, b, rtol=1e-6, atol=1e-9):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def _batch(device, seed=0, holes=False):
    """(rewards[B], group ids [B], mask[B, T], verl's token-level rewards, verl's index)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if holes:  # multi-turn: a tool response masked out in the middle of some rows (lengths kept)
        mask = torch.zeros(len(LENGTHS), T, dtype=torch.bool)
        for i, n in enumerate(LENGTHS):
            cols = list(range(n)) if i % 2 else [c for c in range(T) if c not in (1, 2)][:n]
            mask[i, cols] = True
    rewards = torch.randn(len(IDS), generator=g, dtype=torch.float64)
    rewards[[0, 5, 9]] = 0.0  # zero rewards: GPG's α counts the non-zero ones
    last = torch.tensor([int(row.nonzero().max()) for row in mask])
    tlr = torch.zeros(len(IDS), T, dtype=torch.float64)
    tlr[torch.arange(len(IDS)), last] = rewards
    ids = torch.tensor(IDS)
    return rewards.to(device), ids.to(device), mask.to(device), tlr.to(device), np.array(IDS)


def _token_inputs(device, mask, seed=1, spread=1.5):
    """(π_old log-probs, Σ_v π_v² consistent with them, token IS weights) [B, T]."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    p = old.exp()
    spp = p**2 + (1 - p) ** 2 * torch.rand(mask.shape, generator=g, dtype=torch.float64)
    w = torch.exp(spread * torch.randn(mask.shape, generator=g, dtype=torch.float64)).clamp(max=2.0)
    return old.to(device), spp.to(device), w.to(device)


@pytest.fixture
def verl(verl091):
    return verl091.core_algos


def test_gpg_estimator_equals_verl(verl, device):
    """verl ``compute_gpg_outcome_advantage``: α(r − mean_g)/F_norm, α = B / #non-zero rewards (α in
    float32 in verl: the 1e-6 tolerance)."""
    r, ids, mask, tlr, index = _batch(device)
    theirs, _ = verl.compute_gpg_outcome_advantage(tlr, mask.double(), index)
    _close(broadcast_to_tokens(gpg_advantages(r, group_ids=ids), mask), theirs)
    ours = compute_advantages(AdvantageConfig(estimator="gpg"), r, group_ids=ids)
    _close(broadcast_to_tokens(ours, mask), theirs)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_equals_verl(norm, verl, device):
    """verl ``compute_grpo_passk_outcome_advantage``: the group's best gets r_max − r_2nd (÷ std + ε);
    group 2 ties for the maximum (all 0 whichever topk picks)."""
    r, ids, mask, tlr, index = _batch(device, seed=2)
    r[7] = r[8] = 0.5
    tlr = broadcast_to_tokens(r, mask) * (mask.cumsum(1) == mask.sum(1, keepdim=True))
    theirs, _ = verl.compute_grpo_passk_outcome_advantage(
        tlr, mask.double(), index, config={"norm_adv_by_std_in_grpo": norm}
    )
    _close(broadcast_to_tokens(grpo_passk_advantages(r, group_ids=ids, normalize_std=norm), mask), theirs)
    cfg = AdvantageConfig(estimator="grpo_passk", norm_adv_by_std_in_grpo=norm)
    _close(broadcast_to_tokens(compute_advantages(cfg, r, group_ids=ids), mask), theirs)
    assert int((theirs.abs().sum(1) > 0).sum()) == 3  # one best response in each group without a tie


def test_gdpo_equals_verl_one_reward_and_several(verl, device):
    """verl ``compute_gdpo_outcome_advantage``: GRPO per reward component, weighted sum, ``masked_whiten``
    over the tokens (= ours with the response lengths). Several components go through verl's trainer path
    (``gdpo_reward_keys``: each component placed on the last response token, in float32)."""
    r, ids, mask, tlr, index = _batch(device, seed=3)
    lengths = mask.sum(1)
    theirs, _ = verl.compute_gdpo_outcome_advantage(tlr, mask.double(), index)
    _close(broadcast_to_tokens(gdpo_advantages(r, group_ids=ids, lengths=lengths), mask), theirs)
    _close(
        broadcast_to_tokens(
            compute_advantages(AdvantageConfig(estimator="gdpo"), r, group_ids=ids, lengths=lengths), mask
        ),
        theirs,
    )
    g = torch.Generator().manual_seed(4)
    comps = torch.stack([(torch.rand(len(IDS), generator=g) > 0.5).double(), torch.randn(len(IDS), generator=g)], 1)
    comps = comps.to(device)
    prompt_len = 3
    attention = torch.cat([torch.ones(len(IDS), prompt_len, dtype=torch.long, device=device), mask.long()], 1)
    batch = {"prompts": torch.zeros(len(IDS), prompt_len, device=device), "attention_mask": attention}
    keys, weights = ["format_reward", "accuracy_reward"], [0.3, 1.7]
    non_tensor = {k: comps[:, j].cpu().numpy() for j, k in enumerate(keys)}
    config = {"gdpo_reward_keys": keys, "gdpo_reward_weights": weights}
    theirs, _ = verl.compute_gdpo_outcome_advantage(
        tlr, mask.double(), index, config=config, non_tensor_batch=non_tensor, batch=batch
    )
    ours = gdpo_advantages(r, group_ids=ids, reward_components=comps, reward_weights=weights, lengths=lengths)
    _close(broadcast_to_tokens(ours, mask), theirs)  # verl builds the components in float32: within 1e-6


def test_remax_equals_verl(verl, device):
    """verl ``compute_remax_outcome_advantage``: reward-to-go minus the greedy response's reward."""
    r, _, mask, tlr, _ = _batch(device, seed=5)
    base = torch.randn(len(IDS), generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(device)
    theirs, _ = verl.compute_remax_outcome_advantage(tlr, base, mask.double())
    _close(broadcast_to_tokens(remax_advantages(r, base), mask), theirs)
    ours = compute_advantages(AdvantageConfig(estimator="remax"), r, 3, reward_baselines=base)
    _close(broadcast_to_tokens(ours, mask), theirs)


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [False, True])
def test_optimal_token_baseline_equals_verl(zero_tail, with_is, verl, device):
    """verl ``compute_optimal_token_baseline_advantage``: B_t = Σ G_t W_t / (Σ W_t + ε) per group and column,
    W_t the cumulative Σ (1 − 2π + Σπ²)·ρ̄²; zero tail on group 0's unique longest response."""
    r, ids, mask, tlr, index = _batch(device, seed=6)
    old, spp, w = _token_inputs(device, mask)
    w = w if with_is else None
    theirs, _ = verl.compute_optimal_token_baseline_advantage(
        tlr, mask.double(), index, old, spp, rollout_is_weights=w, handle_zero_tail=zero_tail
    )
    ours = optimal_token_baseline_advantages(
        r, mask, old, spp, group_ids=ids, token_is_weights=w, handle_zero_tail=zero_tail
    )
    _close(ours, theirs)
    cfg = AdvantageConfig(estimator="optimal_token_baseline", handle_zero_tail=zero_tail)
    via = compute_advantages(cfg, r, group_ids=ids, mask=mask, old_logp=old, sum_pi_squared=spp, token_is_weights=w)
    _close(via, theirs)
    if zero_tail:  # past the second-longest (5) the longest response's advantage is its reward
        _close(ours[2, 5:7], r[2].expand(2))


@pytest.mark.parametrize("holes", [False, True])
def test_tir_optimal_token_baseline_equals_verl(holes, verl, device):
    """verl ``compute_multi_turn_optimal_token_baseline_advantage``: the same baseline indexed by each
    response's own token count, for masks with holes (tool outputs masked); with contiguous masks it
    equals the column form."""
    r, ids, mask, tlr, index = _batch(device, seed=7, holes=holes)
    old, spp, w = _token_inputs(device, mask, seed=8)
    theirs, _ = verl.compute_multi_turn_optimal_token_baseline_advantage(
        tlr, mask.double(), index, old, spp, rollout_is_weights=w
    )
    cfg = AdvantageConfig(estimator="tir_optimal_token_baseline")
    ours = compute_advantages(cfg, r, group_ids=ids, mask=mask, old_logp=old, sum_pi_squared=spp, token_is_weights=w)
    _close(ours, theirs)
    columns = optimal_token_baseline_advantages(r, mask, old, spp, group_ids=ids, token_is_weights=w)
    assert torch.allclose(columns, ours) != holes  # the two forms differ exactly when the mask has holes


def test_singleton_groups_differ_from_verl_as_documented(verl, device):
    """A group of one: ours A = 0 (no baseline to compare with), verl's GPG and OTB keep the reward."""
    r, _, mask, tlr, _ = _batch(device, seed=9)
    ids = torch.arange(len(IDS), device=device)
    old, spp, _ = _token_inputs(device, mask)
    assert bool((gpg_advantages(r, group_ids=ids) == 0).all())
    assert bool((optimal_token_baseline_advantages(r, mask, old, spp, group_ids=ids) == 0).all())
    theirs, _ = verl.compute_optimal_token_baseline_advantage(tlr, mask.double(), np.arange(len(IDS)), old, spp)
    _close(theirs, broadcast_to_tokens(r, mask))


def test_gpg_loss_equals_verl(verl091, device):
    """verl ``compute_policy_loss_gpg`` (``register_policy_loss("gpg")``): −w·A·log π, ``agg_loss``;
    values and gradients, two aggregations, through ``loss.type: gpg``."""
    verl = verl091.core_algos
    _, _, mask, _, _ = _batch(device)
    g = torch.Generator().manual_seed(10)
    logp = (-torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2).to(device).requires_grad_(True)
    adv = torch.randn(mask.shape[0], generator=g, dtype=torch.float64)[:, None].expand(mask.shape).to(device)
    w = (torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2).to(device)
    actor = verl091.config.ActorConfig()
    for ours_agg, verl_agg in (("token_mean", "token-mean"), ("seq_mean_token_sum", "seq-mean-token-sum")):
        a = surrogate_loss(LossConfig(type="gpg", aggregation=ours_agg), LossInputs(logp, None, adv, mask, w))[0]
        (ga,) = torch.autograd.grad(a, logp)
        b = verl.compute_policy_loss_gpg(logp, logp, adv, mask.double(), verl_agg, actor, w)[0]
        (gb,) = torch.autograd.grad(b, logp)
        _close(a.detach(), b.detach())
        _close(ga, gb)
    assert not get_policy_loss_fn("gpg").anchored  # reads no ratio: bypass mode applies IS weights explicitly


@pytest.mark.parametrize("zero_tail", [True, False])
def test_optimal_token_baseline_by_hand(zero_tail, device):
    """One group, r = (1, 0), lengths (2, 1), π_t = 0.5 and Σπ² = 0.5 everywhere: w_t = 1 − 2·0.5 + 0.5 = 0.5,
    W = [[0.5, 1.0], [0.5, ·]]. Column 0: B_0 = (1·0.5 + 0·0.5)/(0.5 + 0.5) = 0.5, A = (0.5, −0.5). Column 1:
    only response 0 reaches it, B_1 = 1·1.0/1.0 = 1, A = 0; with the zero tail (response 0 is the unique
    longest, 2 > 1) B_1 = 0 and A = r = 1."""
    r = torch.tensor([1.0, 0.0], dtype=torch.float64, device=device)
    mask = torch.tensor([[True, True], [True, False]], device=device)
    old = torch.full((2, 2), 0.5, dtype=torch.float64, device=device).log()
    spp = torch.full((2, 2), 0.5, dtype=torch.float64, device=device)
    adv = optimal_token_baseline_advantages(r, mask, old, spp, group_size=2, handle_zero_tail=zero_tail)
    expected = torch.tensor([[0.5, 1.0 if zero_tail else 0.0], [-0.5, 0.0]], dtype=torch.float64, device=device)
    _close(adv, expected, rtol=1e-7, atol=1e-7)
