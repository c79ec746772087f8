"""Off-policy RL math on plain ``[B, T]`` tensors: corrections, losses, advantages, diagnostics.

Independent of Megatron and of any device: the trainer calls
:func:`compute_policy_loss` with its config sections; everything else is public so
users can read and test each formula on its own (formula reference: docs/algo.md).
"""

from moe_rl.algo.tensors import LOG_RATIO_BOUND, metrics_to_floats
from moe_rl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    compute_advantages,
    grpo_advantages,
    logit_grad_sq_norm,
    opo_advantages,
    opob_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from moe_rl.algo.aggregation import AGGREGATIONS, aggregate, default_denominator
from moe_rl.algo.covariance_losses import clip_cov_loss, kl_cov_loss, token_covariance
from moe_rl.algo.importance import icepop_weights, sequence_icepop_weights, truncated_is_weights, weight_stats
from moe_rl.algo.kl import KL_ESTIMATORS, kl_penalty
from moe_rl.algo.losses import cispo_loss, gspo_loss, ppo_clip_loss, reinforce_loss
from moe_rl.algo.shaped_losses import dppo_loss, dppo_trust_mask, gmpo_loss, sapo_loss
from moe_rl.algo.surrogates import surrogate_loss
from moe_rl.algo.variance_control import M2PO_DEFAULT_TAU, ess_fraction_from_sums, ess_lr_scale, ess_scaled_lr, m2po_mask
from moe_rl.algo.metrics import offpolicy_metrics
from moe_rl.algo.policy_loss import (
    LOSS_TYPES,
    CorrectionConfigLike,
    LossConfigLike,
    PreparedCorrections,
    compute_policy_loss,
    needs_policy_prepass,
    policy_loss,
    prepare_corrections,
)
from moe_rl.algo.rejection import (
    RS_MODES,
    chained_rejection_mask,
    opsm_mask,
    rejection_mask,
    token_divergence,
    token_veto,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "LOG_RATIO_BOUND",
    "LOSS_TYPES",
    "M2PO_DEFAULT_TAU",
    "RS_MODES",
    "CorrectionConfigLike",
    "LossConfigLike",
    "PreparedCorrections",
    "aggregate",
    "broadcast_to_tokens",
    "chained_rejection_mask",
    "cispo_loss",
    "clip_cov_loss",
    "compute_advantages",
    "compute_policy_loss",
    "default_denominator",
    "dppo_loss",
    "dppo_trust_mask",
    "ess_fraction_from_sums",
    "ess_lr_scale",
    "ess_scaled_lr",
    "gmpo_loss",
    "grpo_advantages",
    "gspo_loss",
    "icepop_weights",
    "kl_cov_loss",
    "kl_penalty",
    "logit_grad_sq_norm",
    "m2po_mask",
    "metrics_to_floats",
    "needs_policy_prepass",
    "offpolicy_metrics",
    "opo_advantages",
    "opob_advantages",
    "opsm_mask",
    "policy_loss",
    "ppo_clip_loss",
    "prepare_corrections",
    "reinforce_loss",
    "reinforce_pp_advantages",
    "rejection_mask",
    "rloo_advantages",
    "sapo_loss",
    "sequence_icepop_weights",
    "surrogate_loss",
    "token_covariance",
    "token_divergence",
    "token_veto",
    "truncated_is_weights",
    "weight_stats",
]
