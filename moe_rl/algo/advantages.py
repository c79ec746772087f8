"""Outcome-reward advantages ``adv[B]`` from ``rewards[B]``: group baselines and batch whitening.

Owns GRPO, RLOO, REINFORCE++ (with and without group baseline), OPO and VCPO's
minimum-variance off-policy baseline (OPOB), each registered by its ``advantage.estimator``
(``moe_rl.algo.registry.register_adv_est``). Groups are given either by ``group_size``
(the G responses of each prompt contiguous, B = num_prompts · G) or by ``group_ids[B]``
(any integers; groups may have unequal sizes, including 1). A singleton group has no
baseline to compare against: its advantage is defined as 0 for every group-baseline
estimator (verl instead keeps the raw reward there; see docs/algo.md). Sources: seed 000,
"IS-aware advantage estimators" and "ESS-guided variance control".
"""

from __future__ import annotations

import torch

from moe_rl.algo.registry import AdvantageInputs, get_adv_estimator_fn, register_adv_est


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or not rewards.is_floating_point():
        got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards: expected a 1-D float tensor [B], got {got}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards: expected finite values, got NaN or inf")
    return rewards


def group_index(rewards: torch.Tensor, group_size: int | None, group_ids: torch.Tensor | None) -> torch.Tensor:
    """Dense group index ``g[B]`` in [0, num_groups) from ``group_size`` or ``group_ids[B]`` (exactly one)."""
    _check_rewards(rewards)
    n = rewards.numel()
    if (group_size is None) == (group_ids is None):
        raise ValueError("advantages: pass exactly one of group_size (contiguous equal groups) or group_ids [B]")
    if group_ids is None:
        if int(group_size) < 1 or n % int(group_size) != 0:
            raise ValueError(f"group_size: expected an integer ≥ 1 dividing B={n}, got {group_size}")
        return torch.arange(n, device=rewards.device) // int(group_size)
    if not isinstance(group_ids, torch.Tensor) or group_ids.shape != rewards.shape or group_ids.is_floating_point():
        got = tuple(group_ids.shape) if isinstance(group_ids, torch.Tensor) else type(group_ids).__name__
        raise ValueError(f"group_ids: expected an integer tensor of shape ({n},) like rewards, got {got}")
    return torch.unique(group_ids.to(rewards.device), return_inverse=True)[1]


def _group_sum(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-sample sum of ``x[B]`` over its group ``g[B]`` (broadcast back to [B])."""
    sums = torch.zeros(int(g.max()) + 1, dtype=x.dtype, device=x.device).index_add_(0, g, x)
    return sums[g]


def _weighted_baseline(rewards, g, weights):
    """Σ_group w·r / Σ_group w for each sample, and the group sizes (both [B])."""
    count = _group_sum(torch.ones_like(rewards), g)
    num, den = _group_sum(weights * rewards, g), _group_sum(weights, g)
    plain = _group_sum(rewards, g) / count
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(rewards.dtype).tiny), plain), count


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO group-relative advantages ``adv[B]`` from ``rewards[B]``.

    A_i = (r_i − mean_g r) / (std_g r + eps) with the unbiased (n−1) group std, or
    A_i = r_i − mean_g r when ``normalize_std=False`` (Dr. GRPO). A group whose
    rewards are all equal, and a singleton group, get A = 0.
    """
    g = group_index(rewards, group_size, group_ids)
    mean, count = _weighted_baseline(rewards, g, torch.ones_like(rewards))
    centred = torch.where(count > 1, rewards - mean, torch.zeros_like(rewards))
    if not normalize_std:
        return centred
    var = _group_sum(centred * centred, g) / (count - 1).clamp_min(1)
    return centred / (var.sqrt() + eps)


def rloo_advantages(
    rewards: torch.Tensor, group_size: int | None = None, group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """RLOO leave-one-out advantages ``adv[B]``: A_i = r_i − mean_{j≠i} r_j = n/(n−1)·(r_i − mean_g r); 0 if n = 1."""
    g = group_index(rewards, group_size, group_ids)
    mean, count = _weighted_baseline(rewards, g, torch.ones_like(rewards))
    return torch.where(count > 1, (rewards - mean) * count / (count - 1).clamp_min(1), torch.zeros_like(rewards))


WHITEN_VAR_EPS = 1e-8  # verl's masked_whiten: (x − mean) · rsqrt(var + 1e-8)


def _whiten(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """(x − mean) · rsqrt(var + 1e-8) over the batch, weighted (e.g. by response length) if ``weights`` is given.

    verl's ``masked_whiten`` form (unbiased variance, 1e-8 added to the *variance*), so a batch of
    nearly equal rewards is not blown up to ±1: rewards [0, 1e-5, 0, 1e-5] give ±0.050, where
    (x − mean)/(std + 1e-6) gave ±0.738.
    """
    w = torch.ones_like(x) if weights is None else weights.to(x.dtype)
    w = torch.where(w.sum() > 0, w, torch.ones_like(w))  # all-empty responses: count each once, never 0/0
    n = w.sum()
    mean = (w * x).sum() / n
    var = (w * (x - mean) ** 2).sum() / (n - 1).clamp_min(1)  # unbiased, like verl's masked_whiten
    return (x - mean) * torch.rsqrt(var + WHITEN_VAR_EPS)


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    baseline: bool = False,
) -> torch.Tensor:
    """REINFORCE++ ``adv[B]``: batch-whitened rewards, optionally after a group-mean baseline.

    ``baseline=False``: A = whiten(r) over the batch (REINFORCE++, Hu 2025, arXiv:2501.03262).
    ``baseline=True``: A = whiten(r − mean_g r) (REINFORCE++-baseline); singletons get r − r = 0
    before whitening. Group arguments are only needed with ``baseline=True``.
    ``lengths[B]`` (response lengths) weights each sample by its token count in the whitening
    statistics — verl whitens the token-level tensor, which is exactly that; without it every
    sequence counts once. whiten(x) = (x − mean)·rsqrt(var + 1e-8), verl's form
    (``advantage.eps`` is GRPO's and is not used here).
    """
    _check_rewards(rewards)
    x = rewards
    if baseline:
        g = group_index(rewards, group_size, group_ids)
        mean, _ = _weighted_baseline(rewards, g, torch.ones_like(rewards))
        x = rewards - mean
    if lengths is not None and lengths.shape != rewards.shape:
        raise ValueError(f"lengths: expected shape {tuple(rewards.shape)}, got {tuple(lengths.shape)}")
    return _whiten(x, lengths)


def opo_advantages(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """OPO ``adv[B]``: A_i = r_i − Σ_g |y_j| r_j / Σ_g |y_j| (length-weighted group baseline; 0 if n = 1).

    On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585); ``lengths[B]``
    are response token counts.
    """
    g = group_index(rewards, group_size, group_ids)
    if not isinstance(lengths, torch.Tensor) or lengths.shape != rewards.shape or bool((lengths < 0).any()):
        raise ValueError(f"lengths: expected non-negative response lengths of shape {tuple(rewards.shape)}")
    base, count = _weighted_baseline(rewards, g, lengths.to(rewards.dtype))
    return torch.where(count > 1, rewards - base, torch.zeros_like(rewards))


def opob_advantages(
    rewards: torch.Tensor,
    is_weights: torch.Tensor,
    grad_sq_norms: torch.Tensor,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """VCPO's minimum-variance off-policy baseline (OPOB): ``adv[B]`` = r_i − b*_g.

    b*_g = Σ_g w_j² ‖g_j‖² r_j / Σ_g w_j² ‖g_j‖² (Huang et al. 2026, arXiv:2602.17616;
    seed 000, "ESS-guided variance control"), with ``is_weights[B]`` the sequence IS weights
    w_j and ``grad_sq_norms[B]`` a proxy for each sample's squared gradient norm
    (see :func:`logit_grad_sq_norm`). Where every weight of a group is 0 the plain mean is
    used; singleton groups get 0.
    """
    g = group_index(rewards, group_size, group_ids)
    for name, t in (("is_weights", is_weights), ("grad_sq_norms", grad_sq_norms)):
        if not isinstance(t, torch.Tensor) or t.shape != rewards.shape or not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: expected a finite tensor of shape {tuple(rewards.shape)}")
        if bool((t < 0).any()):
            raise ValueError(f"{name}: expected non-negative values")
    weights = is_weights.to(rewards.dtype) ** 2 * grad_sq_norms.to(rewards.dtype)
    base, count = _weighted_baseline(rewards, g, weights)
    return torch.where(count > 1, rewards - base, torch.zeros_like(rewards))


def logit_grad_sq_norm(logp: torch.Tensor, mask: torch.Tensor, sum_p_sq: torch.Tensor | None = None) -> torch.Tensor:
    """Proxy ``n[B]`` for ‖∇ log π(y_i)‖²: the squared norm of the gradient w.r.t. the logits.

    Per token, ∂ log p(y_t)/∂z = onehot(y_t) − p, whose squared norm is 1 − 2 p(y_t) + Σ_v p_v².
    ``sum_p_sq[B, T]`` (Σ_v p_v² from the learner's softmax) gives that exactly; without it the
    sampled-token part (1 − p(y_t))² is used (a lower bound). Summed over the response's tokens
    (cross-token terms ignored). Inputs: ``logp[B, T]``, ``mask[B, T]``.
    """
    p = torch.exp(logp.detach())
    per_tok = (1 - p) ** 2 if sum_p_sq is None else 1 - 2 * p + sum_p_sq.detach()
    return torch.where(mask.bool(), per_tok, torch.zeros_like(per_tok)).sum(dim=1)


def broadcast_to_tokens(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``adv[B]`` → ``adv[B, T]``, zero on padding of ``mask[B, T]``."""
    if adv.dim() != 1 or adv.shape[0] != mask.shape[0]:
        raise ValueError(f"adv: expected shape ({mask.shape[0]},), got {tuple(adv.shape)}")
    return adv[:, None] * mask.to(adv.dtype)


@register_adv_est("grpo")
def _grpo(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    return grpo_advantages(x.rewards, x.group_size, normalize_std=True, eps=adv_cfg.eps, group_ids=x.group_ids)


@register_adv_est("grpo_no_std")
def _grpo_no_std(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    return grpo_advantages(x.rewards, x.group_size, normalize_std=False, group_ids=x.group_ids)


@register_adv_est("rloo")
def _rloo(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    return rloo_advantages(x.rewards, x.group_size, x.group_ids)


@register_adv_est("reinforce_pp")
def _reinforce_pp(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    return reinforce_pp_advantages(x.rewards, None, None, x.lengths, baseline=False)


@register_adv_est("reinforce_pp_baseline")
def _reinforce_pp_baseline(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    return reinforce_pp_advantages(x.rewards, x.group_size, x.group_ids, x.lengths, baseline=True)


@register_adv_est("opo")
def _opo(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    if x.lengths is None:
        raise ValueError("advantage.estimator='opo' needs the response lengths [B]; got lengths=None")
    return opo_advantages(x.rewards, x.lengths, x.group_size, x.group_ids)


@register_adv_est("vcpo_opob")
def _vcpo_opob(x: AdvantageInputs, adv_cfg) -> torch.Tensor:
    if x.is_weights is None or x.grad_sq_norms is None:
        raise ValueError("advantage.estimator='vcpo_opob' needs is_weights [B] and grad_sq_norms [B]; got None")
    return opob_advantages(x.rewards, x.is_weights, x.grad_sq_norms, x.group_size, x.group_ids)


def compute_advantages(
    adv_cfg,
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    group_ids: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    grad_sq_norms: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    reward_components: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    token_is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``adv[B]`` (or ``[B, T]`` for the token baselines) from ``rewards[B]`` as the config's ``advantage`` asks.

    ``adv_cfg`` needs ``estimator`` (a registered name, ``moe_rl.algo.ADVANTAGE_ESTIMATORS``) and ``eps``. ``opo``
    needs ``lengths[B]``; ``vcpo_opob`` needs ``is_weights[B]`` and ``grad_sq_norms[B]``;
    ``reinforce_pp`` and ``gdpo`` use ``lengths`` if given (token-weighted whitening, as verl); ``remax``
    needs ``reward_baselines[B]``; ``gdpo`` with ``gdpo_reward_keys`` needs ``reward_components[B, K]``;
    ``optimal_token_baseline`` / ``tir_optimal_token_baseline`` need ``mask``, ``old_logp`` and
    ``sum_pi_squared`` [B, T] (``token_is_weights`` [B, T] optional) and return ``[B, T]``.
    """
    x = AdvantageInputs(
        rewards,
        group_size,
        group_ids,
        lengths,
        is_weights,
        grad_sq_norms,
        reward_baselines,
        reward_components,
        mask,
        old_logp,
        sum_pi_squared,
        token_is_weights,
    )
    return get_adv_estimator_fn(adv_cfg.estimator)(x, adv_cfg)
