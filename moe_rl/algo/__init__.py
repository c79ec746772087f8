"""Off-policy RL math on plain ``[B, T]`` tensors: corrections, losses, advantages, diagnostics.

Independent of Megatron and of any device: the trainer calls
:func:`compute_policy_loss` with its config sections; everything else is public so
users can read and test each formula on its own (formula reference: docs/algo.md).
"""

from moe_rl.algo._tensors import LOG_RATIO_BOUND, metrics_to_floats
from moe_rl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    compute_advantages,
    grpo_advantages,
    rloo_advantages,
)
from moe_rl.algo.aggregation import AGGREGATIONS, aggregate
from moe_rl.algo.importance import icepop_weights, truncated_is_weights, weight_stats
from moe_rl.algo.kl import KL_ESTIMATORS, kl_penalty
from moe_rl.algo.losses import cispo_loss, gspo_loss, ppo_clip_loss, reinforce_loss
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
from moe_rl.algo.rejection import RS_MODES, opsm_mask, rejection_mask, token_divergence, token_veto

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "LOG_RATIO_BOUND",
    "LOSS_TYPES",
    "RS_MODES",
    "CorrectionConfigLike",
    "LossConfigLike",
    "PreparedCorrections",
    "aggregate",
    "broadcast_to_tokens",
    "cispo_loss",
    "compute_advantages",
    "compute_policy_loss",
    "grpo_advantages",
    "gspo_loss",
    "icepop_weights",
    "kl_penalty",
    "metrics_to_floats",
    "needs_policy_prepass",
    "offpolicy_metrics",
    "opsm_mask",
    "policy_loss",
    "ppo_clip_loss",
    "prepare_corrections",
    "reinforce_loss",
    "rejection_mask",
    "rloo_advantages",
    "token_divergence",
    "token_veto",
    "truncated_is_weights",
    "weight_stats",
]
