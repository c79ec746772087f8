"""The optimal token baselines (OTB, arXiv:2602.07078): a baseline per response position, ``adv[B, T]``.

Registered as verl 0.9.1's ``optimal_token_baseline`` and ``tir_optimal_token_baseline``; the formula is
read from verl's ``compute_optimal_token_baseline_advantage`` and
``compute_multi_turn_optimal_token_baseline_advantage`` (``verl/trainer/ppo/core_algos.py``) and checked
against them in tests/algo/test_verl_estimators.py. Inputs beyond the rewards: the response ``mask[B, T]``,
π_old's ``old_logp[B, T]`` and Σ_v π_v² of π_old's softmax per token (``sum_pi_squared[B, T]``), and
optionally the token IS weights ρ̄_t (verl's ``rollout_is_weights``).
"""

from __future__ import annotations

import torch

from moe_rl.algo.advantages import _check_rewards, _group_sum, group_index
from moe_rl.algo.registry import AdvantageInputs, register_adv_est
from moe_rl.algo.tensors import check_logp, check_mask

OTB_EPS = 1e-8  # verl's epsilon for the baseline's denominator


def _group_amax(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(int(g.max()) + 1, dtype=x.dtype, device=x.device)  # x ≥ 0 here (lengths)
    return out.scatter_reduce(0, g, x, "amax")[g]


def _token_input(name: str, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    t = check_logp(name, t.detach(), mask)
    if bool((torch.where(mask, t, torch.zeros_like(t)) < 0).any()):
        raise ValueError(f"{name}: expected non-negative values at every masked-in position")
    return t


def optimal_token_baseline_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    token_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    compact: bool = False,
    eps: float = OTB_EPS,
) -> torch.Tensor:
    """OTB ``adv[B, T]`` = r_i − B_t on the response tokens (0 elsewhere), from an outcome reward ``rewards[B]``.

    Per token, the squared score-norm proxy w_t = 1 − 2π_t + Σ_v π_v² (π_t = exp(``old_logp``), i.e.
    ‖onehot(y_t) − π‖²), times ρ̄_t² when ``token_is_weights`` are given; W_t = Σ_{j≤t} w_j over the
    response tokens (cumulative path variance). Per group and position t, over the responses that reach t,
    B_t = Σ_i G_{i,t} W_{i,t} / (Σ_i W_{i,t} + ε), G_{i,t} = r_i (the reward-to-go of an outcome reward).
    Position t is the column (``optimal_token_baseline``) or, with ``compact`` (``tir_optimal_token_baseline``,
    multi-turn masks with holes), the index among the response's own tokens. ``handle_zero_tail``: where a
    group's longest response is longer than all others, its baseline beyond the second-longest's length
    is 0 (it alone reaches there, so B_t ≈ r_i would cancel its reward). A group with fewer than two
    non-empty responses gets A = 0 (verl: the return r_i).
    """
    _check_rewards(rewards)
    mask = check_mask(mask, allow_empty=True)
    if mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"mask: expected {rewards.shape[0]} rows like rewards, got shape {tuple(mask.shape)}")
    g = group_index(rewards, group_size, group_ids)
    dt = rewards.dtype
    old = check_logp("old_logp", old_logp.detach(), mask).to(dt)
    spp = _token_input("sum_pi_squared", sum_pi_squared, mask).to(dt)
    w = 1 - 2 * torch.exp(old) + spp
    if token_is_weights is not None:
        w = w * _token_input("token_is_weights", token_is_weights, mask).to(dt) ** 2
    zero = torch.zeros((), dtype=dt, device=rewards.device)
    big_w = torch.where(mask, w, zero).cumsum(dim=1)  # W_t at each column
    lengths = mask.sum(dim=1)
    steps = torch.arange(mask.shape[1], device=mask.device)
    if compact:  # the k-th response token of each row at column k
        order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
        pos_mask = steps[None, :] < lengths[:, None]
        big_w = torch.where(pos_mask, big_w.gather(1, order), zero)
    else:
        pos_mask = mask
        big_w = torch.where(mask, big_w, zero)
    nonempty = lengths > 0
    members = _group_sum(nonempty.to(dt), g)
    n_groups = int(g.max()) + 1
    num = torch.zeros(n_groups, mask.shape[1], dtype=dt, device=rewards.device).index_add_(
        0, g, rewards[:, None] * big_w
    )
    den = torch.zeros_like(num).index_add_(0, g, big_w)
    baseline = num[g] / (den[g] + eps)
    if handle_zero_tail:
        longest = _group_amax(lengths, g)
        n_longest = _group_sum(((lengths == longest) & nonempty).to(dt), g)
        second = _group_amax(torch.where(lengths < longest, lengths, torch.zeros_like(lengths)), g)
        tail_row = (lengths == longest) & (n_longest == 1) & (members > 1)
        baseline = torch.where(tail_row[:, None] & (steps[None, :] >= second[:, None]), zero, baseline)
    adv = torch.where(pos_mask & (members > 1)[:, None], rewards[:, None] - baseline, zero)
    if compact:  # back to the columns: token t of row i is its k(t)-th response token
        k = (mask.cumsum(dim=1) - 1).clamp_min(0)
        adv = torch.where(mask, adv.gather(1, k), zero)
    return adv


def _otb_inputs(x: AdvantageInputs, name: str) -> None:
    missing = [f for f in ("mask", "old_logp", "sum_pi_squared") if getattr(x, f) is None]
    if missing:
        raise ValueError(
            f"advantage.estimator={name!r} needs mask, old_logp and sum_pi_squared [B, T] (Σ_v π_v² from the "
            f"learner's old-log-prob pass); got None for {', '.join(missing)}"
        )


def _otb(x: AdvantageInputs, adv_cfg, name: str, compact: bool) -> torch.Tensor:
    _otb_inputs(x, name)
    return optimal_token_baseline_advantages(
        x.rewards,
        x.mask,
        x.old_logp,
        x.sum_pi_squared,
        x.group_size,
        x.group_ids,
        x.token_is_weights,
        handle_zero_tail=getattr(adv_cfg, "handle_zero_tail", True),
        compact=compact,
    )


@register_adv_est("optimal_token_baseline")
def _optimal_token_baseline(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    return _otb(x, adv_cfg, "optimal_token_baseline", compact=False)


@register_adv_est("tir_optimal_token_baseline")
def _tir_optimal_token_baseline(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    return _otb(x, adv_cfg, "tir_optimal_token_baseline", compact=True)
