"""KL-penalty estimators between the policy π_θ and a reference policy, per token.

Owns k1 / k2 / k3 / abs and their straight-through "+" forms (seed 000, "KL estimator
variants"; Schulman 2020). Sampling is from π_θ (the rollout), so with
x = log π_ref − log π_θ: k1 = −x, abs = |x|, k2 = ½x², k3 = eˣ − x − 1 (≥ 0, unbiased for
KL(π_θ‖π_ref) on-policy).
"""

from __future__ import annotations

import torch

from moe_rl.algo.tensors import LOG_RATIO_BOUND

KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1_plus", "k2_plus", "k3_plus", "abs_plus")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k2") -> torch.Tensor:
    """Per-token KL estimate ``kl[B, T]`` from ``logp[B, T]`` (with grad) and ``ref_logp[B, T]``.

    ``<k>_plus`` is straight-through: the forward value of estimator k, the backward gradient
    of k2, i.e. (log π_θ − log π_ref)·∇log π_θ — the unbiased on-policy KL gradient
    (seed 000, "KL estimator variants": kl = bwd − sg[bwd] + sg[fwd]). verl's ``k1+`` /
    ``k3+`` (``low_var_kl+``) are ``k1_plus`` / ``k3_plus``; ``k2_plus`` equals ``k2``.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp: expected shape {tuple(logp.shape)} (same as logp), got {tuple(ref_logp.shape)}")
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: expected one of {KL_ESTIMATORS}, got {estimator!r}")
    diff = logp - ref_logp.detach()  # log π_θ − log π_ref
    base = estimator.removesuffix("_plus")
    if base == "k1":
        value = diff
    elif base == "abs":
        value = diff.abs()
    elif base == "k2":
        value = 0.5 * diff * diff
    else:
        x = (-diff).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        value = torch.expm1(x) - x  # expm1 keeps k3 ≥ 0 for |x| ≪ 1, where eˣ − 1 would cancel
    if not estimator.endswith("_plus"):
        return value
    k2 = 0.5 * diff * diff
    return k2 - k2.detach() + value.detach()
