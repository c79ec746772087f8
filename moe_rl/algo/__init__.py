"""Off-policy RL math on plain ``[B, T]`` tensors: corrections, losses, advantages, diagnostics.

Independent of Megatron and of any device: the trainer calls
:func:`compute_policy_loss` with its config sections; everything else is public so
users can read and test each formula on its own (formula reference: docs/algo.md).
Losses and advantage estimators are registered by name (``moe_rl.algo.registry``); importing
this package imports every module that registers one, so ``LOSS_TYPES`` and
``ADVANTAGE_ESTIMATORS`` list them all.
"""

from moe_rl.algo.advantages import (
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
from moe_rl.algo.covariance_losses import ClipCovParams, KLCovParams, clip_cov_loss, kl_cov_loss, token_covariance
from moe_rl.algo.group_estimators import (
    gdpo_advantages,
    gpg_advantages,
    grpo_passk_advantages,
    remax_advantages,
)
from moe_rl.algo.importance import icepop_weights, sequence_icepop_weights, truncated_is_weights, weight_stats
from moe_rl.algo.kl import KL_ESTIMATORS, kl_penalty
from moe_rl.algo.losses import (
    CISPOParams,
    GPGParams,
    GSPOParams,
    PPOClipParams,
    ReinforceParams,
    cispo_loss,
    gpg_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
    reinforce_loss,
)
from moe_rl.algo.metrics import offpolicy_metrics
from moe_rl.algo.offpolicy_losses import OAPLParams, TOPRParams, VESPOParams, oapl_loss, topr_loss, vespo_loss
from moe_rl.algo.policy_loss import (
    CorrectionConfigLike,
    PreparedCorrections,
    compute_policy_loss,
    needs_policy_prepass,
    policy_loss,
    prepare_corrections,
)
from moe_rl.algo.prefix_losses import (
    ASPOParams,
    CTPOParams,
    MinPROParams,
    aspo_loss,
    ctpo_loss,
    minpro_loss,
    prefix_min_log_ratio,
)
from moe_rl.algo.proximal import a3po_needs_prepass, a3po_proximal_logp
from moe_rl.algo.registry import (
    AdvantageInputs,
    LossConfigLike,
    LossInputs,
    LossParams,
    PolicyLoss,
    adv_estimator_names,
    get_adv_estimator,
    get_adv_estimator_fn,
    get_loss,
    get_policy_loss_fn,
    policy_loss_names,
    register_adv_est,
    register_loss,
    register_policy_loss,
    surrogate_loss,
)
from moe_rl.algo.rejection import (
    RS_MODES,
    chained_rejection_mask,
    opsm_mask,
    rejection_mask,
    token_divergence,
    token_veto,
    trm_mask,
)
from moe_rl.algo.shaped_losses import (
    DPPOParams,
    GMPOParams,
    SAPOParams,
    dppo_kl_loss,
    dppo_trust_mask,
    dppo_tv_loss,
    gmpo_loss,
    sapo_loss,
)
from moe_rl.algo.tensors import LOG_RATIO_BOUND, metrics_to_floats
from moe_rl.algo.token_baselines import optimal_token_baseline_advantages
from moe_rl.algo.variance_control import (
    M2PO_DEFAULT_TAU,
    ess_fraction_from_sums,
    ess_lr_scale,
    ess_scaled_lr,
    m2po_mask,
)

LOSS_TYPES = policy_loss_names()  # every loss module above has registered its losses
ADVANTAGE_ESTIMATORS = adv_estimator_names()  # likewise every estimator module

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "LOG_RATIO_BOUND",
    "LOSS_TYPES",
    "M2PO_DEFAULT_TAU",
    "RS_MODES",
    "ASPOParams",
    "AdvantageInputs",
    "CISPOParams",
    "CTPOParams",
    "ClipCovParams",
    "CorrectionConfigLike",
    "DPPOParams",
    "GMPOParams",
    "GPGParams",
    "GSPOParams",
    "KLCovParams",
    "LossConfigLike",
    "LossInputs",
    "LossParams",
    "MinPROParams",
    "OAPLParams",
    "PPOClipParams",
    "PolicyLoss",
    "PreparedCorrections",
    "ReinforceParams",
    "SAPOParams",
    "TOPRParams",
    "VESPOParams",
    "a3po_needs_prepass",
    "a3po_proximal_logp",
    "adv_estimator_names",
    "aggregate",
    "aspo_loss",
    "broadcast_to_tokens",
    "chained_rejection_mask",
    "cispo_loss",
    "clip_cov_loss",
    "compute_advantages",
    "compute_policy_loss",
    "ctpo_loss",
    "default_denominator",
    "dppo_kl_loss",
    "dppo_trust_mask",
    "dppo_tv_loss",
    "ess_fraction_from_sums",
    "ess_lr_scale",
    "ess_scaled_lr",
    "gdpo_advantages",
    "get_adv_estimator",
    "get_adv_estimator_fn",
    "get_loss",
    "get_policy_loss_fn",
    "gmpo_loss",
    "gpg_advantages",
    "gpg_loss",
    "grpo_advantages",
    "grpo_passk_advantages",
    "gspo_loss",
    "gspo_token_loss",
    "icepop_weights",
    "kl_cov_loss",
    "kl_penalty",
    "logit_grad_sq_norm",
    "m2po_mask",
    "metrics_to_floats",
    "minpro_loss",
    "needs_policy_prepass",
    "oapl_loss",
    "offpolicy_metrics",
    "opo_advantages",
    "opob_advantages",
    "opsm_mask",
    "optimal_token_baseline_advantages",
    "policy_loss",
    "policy_loss_names",
    "ppo_clip_loss",
    "prefix_min_log_ratio",
    "prepare_corrections",
    "register_adv_est",
    "register_loss",
    "register_policy_loss",
    "reinforce_loss",
    "reinforce_pp_advantages",
    "rejection_mask",
    "remax_advantages",
    "rloo_advantages",
    "sapo_loss",
    "sequence_icepop_weights",
    "surrogate_loss",
    "token_covariance",
    "token_divergence",
    "token_veto",
    "topr_loss",
    "trm_mask",
    "truncated_is_weights",
    "vespo_loss",
    "weight_stats",
]
