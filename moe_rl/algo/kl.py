"""KL-penalty estimators between the policy π_θ and a reference policy, per token.

Owns k1 / k2 / k3 and the straight-through k3+ (seed 000, "KL estimator variants";
Schulman 2020). Sampling is from π_θ (the rollout), so with x = log π_ref − log π_θ:
k1 = −x, k2 = ½x², k3 = eˣ − x − 1 (≥ 0, unbiased for KL(π_θ‖π_ref) on-policy).
"""

from __future__ import annotations

import torch

from moe_rl.algo._tensors import LOG_RATIO_BOUND

KL_ESTIMATORS = ("k1", "k2", "k3", "k3_plus")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate ``kl[B, T]`` from ``logp[B, T]`` (with grad) and ``ref_logp[B, T]``.

    ``k3_plus`` is straight-through: forward value of k3, backward gradient of k2,
    i.e. (log π_θ − log π_ref)·∇log π_θ, the unbiased on-policy KL gradient
    (seed 000, "KL estimator variants": kl = bwd − sg[bwd] + sg[fwd]).
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp: expected shape {tuple(logp.shape)} (same as logp), got {tuple(ref_logp.shape)}")
    diff = logp - ref_logp.detach()  # log π_θ − log π_ref
    if estimator == "k1":
        return diff
    k2 = 0.5 * diff * diff
    if estimator == "k2":
        return k2
    x = (-diff).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    k3 = torch.expm1(x) - x  # expm1 keeps k3 ≥ 0 for |x| ≪ 1, where eˣ − 1 would cancel
    if estimator == "k3":
        return k3
    if estimator == "k3_plus":
        return k2 - k2.detach() + k3.detach()
    raise ValueError(f"kl_estimator: expected one of {KL_ESTIMATORS}, got {estimator!r}")
