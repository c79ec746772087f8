"""Outcome-reward advantages for groups of responses to the same prompt: GRPO and RLOO.

Owns only the group baselines; rewards arrive as ``rewards[B]`` with the G responses
of each prompt contiguous (B = num_prompts · G). Seed 000, "IS-aware advantage
estimators" lists both among verl's estimators.
"""

from __future__ import annotations

import torch


def _groups(rewards: torch.Tensor, group_size: int, min_size: int) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or not rewards.is_floating_point():
        got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards: expected a 1-D float tensor [B], got {got}")
    if int(group_size) < min_size or rewards.numel() % int(group_size) != 0:
        raise ValueError(
            f"group_size: expected an integer ≥ {min_size} dividing B={rewards.numel()}, got {group_size}"
        )
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards: expected finite values, got NaN or inf")
    return rewards.reshape(-1, int(group_size))


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-relative advantages ``adv[B]`` from ``rewards[B]``.

    A_i = (r_i − mean_g r) / (std_g r + eps) with the unbiased (n−1) group std, or
    A_i = r_i − mean_g r when ``normalize_std=False`` (Dr. GRPO). A group whose
    rewards are all equal gets A = 0.
    """
    g = _groups(rewards, group_size, 2)
    centred = g - g.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (g.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO leave-one-out advantages ``adv[B]``: A_i = r_i − mean_{j≠i} r_j = G/(G−1)·(r_i − mean_g r)."""
    g = _groups(rewards, group_size, 2)
    n = g.shape[1]
    return ((g - g.mean(dim=1, keepdim=True)) * (n / (n - 1))).reshape(-1)


def broadcast_to_tokens(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``adv[B]`` → ``adv[B, T]``, zero on padding of ``mask[B, T]``."""
    if adv.dim() != 1 or adv.shape[0] != mask.shape[0]:
        raise ValueError(f"adv: expected shape ({mask.shape[0]},), got {tuple(adv.shape)}")
    return adv[:, None] * mask.to(adv.dtype)


ADVANTAGE_ESTIMATORS = ("grpo", "grpo_no_std", "rloo")


def compute_advantages(adv_cfg, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``adv[B]`` from ``rewards[B]`` as the config's ``advantage`` section asks.

    ``adv_cfg`` needs ``estimator`` ("grpo" | "grpo_no_std" | "rloo") and ``eps``.
    """
    estimator = adv_cfg.estimator
    if estimator == "grpo":
        return grpo_advantages(rewards, group_size, normalize_std=True, eps=adv_cfg.eps)
    if estimator == "grpo_no_std":
        return grpo_advantages(rewards, group_size, normalize_std=False)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_size)
    raise ValueError(f"advantage.estimator: expected one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
