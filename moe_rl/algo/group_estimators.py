"""verl 0.9.1's outcome-reward estimators we lacked: GPG, GRPO Pass@k, GDPO and ReMax, each ``adv[B]``.

Registered under verl's ``adv_estimator`` names (``gpg``, ``grpo_passk``, ``gdpo``, ``remax``); formulas
read from verl 0.9.1's ``verl/trainer/ppo/core_algos.py`` (``compute_gpg_outcome_advantage``,
``compute_grpo_passk_outcome_advantage``, ``compute_gdpo_outcome_advantage``,
``compute_remax_outcome_advantage``) and checked against those functions in tests/algo/test_verl_estimators.py.
Groups as in ``moe_rl.algo.advantages`` (``group_size`` or ``group_ids``); a singleton group gets A = 0
(verl: GPG keeps α·r, Pass@k raises, GDPO's GRPO step keeps r/(1 + ε)). Outcome rewards only: verl's
token-level forms equal ours broadcast to the response tokens when the reward sits on the last token.
"""

from __future__ import annotations

import torch

from moe_rl.algo.advantages import (
    _check_rewards,
    _group_sum,
    _weighted_baseline,
    _whiten,
    group_index,
    grpo_advantages,
)
from moe_rl.algo.registry import AdvantageInputs, register_adv_est


def _group_max(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-sample max of ``x[B]`` over its group (broadcast back to [B])."""
    out = torch.full((int(g.max()) + 1,), -torch.inf, dtype=x.dtype, device=x.device)
    return out.scatter_reduce(0, g, x, "amax")[g]


def _per_sample(name: str, t: torch.Tensor | None, rewards: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.shape != rewards.shape or not bool(torch.isfinite(t).all()):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a finite tensor of shape {tuple(rewards.shape)} like rewards, got {got}")
    return t.to(rewards.dtype)


def gpg_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    f_norm: float = 1.0,
) -> torch.Tensor:
    """GPG ``adv[B]``: A_i = α·(r_i − mean_g r)/F_norm, α = B / max(#{j: r_j ≠ 0}, 1) over the batch.

    verl 0.9.1 ``compute_gpg_outcome_advantage`` (F_norm = 1, its default; α counts the batch's non-zero
    rewards, which up-weights a batch with few rewarded samples; GPG, Chu et al. 2025, arXiv:2504.02546).
    A singleton group gets 0.
    """
    g = group_index(rewards, group_size, group_ids)
    if not float(f_norm) > 0:
        raise ValueError(f"f_norm: expected > 0, got {f_norm}")
    mean, count = _weighted_baseline(rewards, g, torch.ones_like(rewards))
    alpha = rewards.numel() / max(int(torch.count_nonzero(rewards)), 1)
    return torch.where(count > 1, alpha * (rewards - mean) / float(f_norm), torch.zeros_like(rewards))


def grpo_passk_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO Pass@k ``adv[B]``: only a group's best response gets A = r_max − r_second (÷ (std_g + ε)).

    verl 0.9.1 ``compute_grpo_passk_outcome_advantage`` (arXiv:2503.19595): per group the top two
    rewards; the best gets r_max − r_2nd, divided by the group's unbiased std + ε when
    ``normalize_std`` (verl's ``norm_adv_by_std_in_grpo``), every other response 0. A tie for the
    maximum gives 0 to all (r_max − r_2nd = 0, whichever verl's topk picks). A singleton group gets 0
    (verl raises).
    """
    g = group_index(rewards, group_size, group_ids)
    count = _group_sum(torch.ones_like(rewards), g)
    gmax = _group_max(rewards, g)
    is_max = rewards == gmax
    n_max = _group_sum(is_max.to(rewards.dtype), g)
    others = _group_max(torch.where(is_max, torch.full_like(rewards, -torch.inf), rewards), g)
    second = torch.where(n_max > 1, gmax, torch.where(torch.isfinite(others), others, gmax))
    adv = gmax - second
    if normalize_std:
        mean, _ = _weighted_baseline(rewards, g, torch.ones_like(rewards))
        std = (_group_sum((rewards - mean) ** 2, g) / (count - 1).clamp_min(1)).sqrt()
        adv = adv / (std + eps)
    return torch.where(is_max & (n_max == 1) & (count > 1), adv, torch.zeros_like(rewards))


def gdpo_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    reward_components: torch.Tensor | None = None,
    reward_weights: list[float] | tuple[float, ...] | None = None,
    lengths: torch.Tensor | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GDPO ``adv[B]``: whiten(Σ_k w_k · GRPO(r_k)) — each reward normalised in its group, then summed.

    verl 0.9.1 ``compute_gdpo_outcome_advantage`` (arXiv:2601.05242): A_k = (r_k − mean_g r_k)/(std_g r_k + ε)
    per reward column k of ``reward_components[B, K]`` (``rewards`` as the one column when None),
    A = Σ_k w_k A_k (``reward_weights``, verl's ``gdpo_reward_weights``; default all 1), then batch
    whitening (x − mean)·rsqrt(var + 1e-8), unbiased — verl's ``masked_whiten`` over the response tokens,
    which is ours with ``lengths[B]`` (each sample weighted by its token count).
    """
    _check_rewards(rewards)
    cols = rewards[:, None] if reward_components is None else reward_components
    if not isinstance(cols, torch.Tensor) or cols.dim() != 2 or cols.shape[0] != rewards.shape[0]:
        got = tuple(cols.shape) if isinstance(cols, torch.Tensor) else type(cols).__name__
        raise ValueError(f"reward_components: expected a tensor [B={rewards.shape[0]}, K], got {got}")
    cols = cols.to(rewards.dtype)
    k = cols.shape[1]
    weights = [1.0] * k if reward_weights is None else [float(w) for w in reward_weights]
    if len(weights) != k:
        raise ValueError(f"gdpo_reward_weights: expected {k} weights (one per reward component), got {len(weights)}")
    total = torch.zeros_like(rewards)
    for j in range(k):
        col = _check_rewards(cols[:, j].contiguous())
        total = total + weights[j] * grpo_advantages(col, group_size, normalize_std, eps, group_ids)
    if lengths is not None and lengths.shape != rewards.shape:
        raise ValueError(f"lengths: expected shape {tuple(rewards.shape)}, got {tuple(lengths.shape)}")
    return _whiten(total, lengths)


def remax_advantages(rewards: torch.Tensor, reward_baselines: torch.Tensor) -> torch.Tensor:
    """ReMax ``adv[B]``: A_i = r_i − b_i, b_i the reward of a greedy response to the same prompt.

    verl 0.9.1 ``compute_remax_outcome_advantage`` (Li et al. 2023, arXiv:2310.10505): the reward-to-go
    minus ``reward_baselines`` on every response token, which for an outcome reward is r_i − b_i.
    """
    _check_rewards(rewards)
    return rewards - _per_sample("reward_baselines", reward_baselines, rewards)


@register_adv_est("gpg")
def _gpg(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    return gpg_advantages(x.rewards, x.group_size, x.group_ids)


@register_adv_est("grpo_passk")
def _grpo_passk(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    norm = getattr(adv_cfg, "norm_adv_by_std_in_grpo", True)
    return grpo_passk_advantages(x.rewards, x.group_size, x.group_ids, norm, adv_cfg.eps)


@register_adv_est("gdpo")
def _gdpo(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    keys = getattr(adv_cfg, "gdpo_reward_keys", None)
    if keys and x.reward_components is None:
        raise ValueError(
            f"advantage.gdpo_reward_keys={list(keys)}: GDPO needs reward_components [B, {len(keys)}]; got None"
        )
    return gdpo_advantages(
        x.rewards,
        x.group_size,
        x.group_ids,
        x.reward_components,
        getattr(adv_cfg, "gdpo_reward_weights", None) if keys else None,
        x.lengths,
        getattr(adv_cfg, "norm_adv_by_std_in_grpo", True),
        adv_cfg.eps,
    )


@register_adv_est("remax")
def _remax(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    if x.reward_baselines is None:
        raise ValueError(
            "advantage.estimator='remax' needs reward_baselines [B] (a greedy response's reward); got None"
        )
    return remax_advantages(x.rewards, x.reward_baselines)
