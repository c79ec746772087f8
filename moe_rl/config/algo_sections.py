"""Config sections of the RL algorithm: off-policy correction, policy loss, advantages, optimizer.

Owns their fields, defaults and within-section rules (``moe_rl.algo`` implements them); the rules
that span sections live in ``schema.ExperimentConfig`` and ``preflight``. Must not import torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moe_rl.config.section import Section

RejectionMode = Literal[
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
]  # fmt: skip


class RejectionCriterion(Section):
    """One rejection criterion of ``correction.rejection``: same meanings as rs_mode / rs_lower / rs_upper."""

    mode: RejectionMode
    lower: float | None = Field(None, ge=0, description="k1 modes: lower ratio bound on pi_old/mu")
    upper: float = Field(..., gt=0, description="k1: upper ratio bound; k2/k3: divergence threshold")

    @model_validator(mode="after")
    def _check(self) -> RejectionCriterion:
        if self.mode.endswith("k1"):
            if self.lower is None:
                raise ValueError(f"correction.rejection: lower is required for ratio-bound mode {self.mode!r}")
            if self.lower >= self.upper:
                raise ValueError(f"correction.rejection: lower={self.lower} must be < upper={self.upper} ({self.mode})")
        elif self.lower is not None:
            raise ValueError(f"correction.rejection: mode {self.mode!r} takes only an upper threshold, got lower")
        return self


class CorrectionConfig(Section):
    """Off-policy correction between rollout (mu), old (pi_old) and current (pi_theta) policies."""

    mode: Literal["bypass", "decoupled"] = "decoupled"
    is_level: Literal["none", "token", "sequence"] = "none"
    is_threshold: float = Field(2.0, gt=0)
    is_batch_normalize: bool = False
    rs_mode: RejectionMode | None = None
    rs_lower: float | None = Field(None, ge=0)
    rs_upper: float | None = Field(None, gt=0)
    icepop: bool = False
    icepop_low: float = Field(0.5, ge=0)
    icepop_high: float = Field(5.0, gt=0)
    icepop_weighted: bool = True
    icepop_level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="band on token ratios, the sequence ratio exp(sum log rho), or its geometric mean"
    )
    rejection: list[RejectionCriterion] = Field(
        default_factory=list, description="several rejection criteria, AND-ed; alternative to rs_mode/rs_lower/rs_upper"
    )
    m2po_tau: float | None = Field(
        None, gt=0, description="M2PO: mask largest (log rho)^2 until their mean <= tau (paper: 0.04); None = off"
    )
    token_veto_threshold: float | None = Field(None, gt=0, lt=1)
    opsm_delta: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> CorrectionConfig:
        if self.icepop_low >= self.icepop_high:
            raise ValueError(f"correction.icepop_low={self.icepop_low} must be < correction.icepop_high={self.icepop_high}")
        if self.rs_mode is not None and self.rs_upper is None:
            raise ValueError(f"correction.rs_upper is required when correction.rs_mode={self.rs_mode!r}")
        if self.rs_mode is not None and self.rs_mode.endswith("k1"):
            if self.rs_lower is None:
                raise ValueError(f"correction.rs_lower is required for ratio-bound mode {self.rs_mode!r}")
            if self.rs_lower >= self.rs_upper:
                raise ValueError(f"correction.rs_lower={self.rs_lower} must be < correction.rs_upper={self.rs_upper}")
        if self.rs_mode is not None and self.rejection:
            raise ValueError(
                "correction.rs_mode and correction.rejection both set: put every criterion in correction.rejection"
            )
        return self


SEQUENCE_LEVEL_LOSSES = ("gspo", "gspo_token", "gmpo")


class LossConfig(Section):
    type: Literal[
        "ppo_clip", "gspo", "gspo_token", "cispo", "reinforce", "sapo", "gmpo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov",
    ] = "ppo_clip"  # fmt: skip
    clip_low: float = Field(0.2, ge=0, description="epsilon_low (dppo_*: divergence bound for A <= 0)")
    clip_high: float = Field(0.28, ge=0, description="epsilon_high (dppo_*: divergence bound for A > 0)")
    dual_clip_c: float | None = Field(None, gt=1)
    cispo_clip_low: float | None = Field(None, ge=0, lt=1, description="CISPO lower clip; None = no lower bound")
    cispo_clip_high: float | None = Field(None, ge=0, description="CISPO upper clip; None = clip_high")
    sapo_tau_pos: float = Field(1.0, gt=0, description="SAPO gate temperature for A > 0")
    sapo_tau_neg: float = Field(1.05, gt=0, description="SAPO gate temperature for A <= 0")
    dppo_ratio_cap: float = Field(20.0, gt=0, description="DPPO truncation C of the stop-gradient ratio")
    clip_cov_ratio: float = Field(2e-4, gt=0, le=1, description="fraction of tokens Clip-Cov may zero")
    clip_cov_lb: float = Field(1.0, description="Clip-Cov candidate covariance lower bound")
    clip_cov_ub: float = Field(5.0, description="Clip-Cov candidate covariance upper bound")
    kl_cov_ratio: float = Field(2e-4, gt=0, le=1, description="fraction of tokens KL-Cov penalises")
    kl_cov_coef: float = Field(0.1, ge=0, description="KL-Cov beta on |log r| (verl ppo_kl_coef 0.1)")
    aggregation: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum", "seq_mean_token_sum",
    ] = "token_mean"  # fmt: skip
    norm_len: int | None = Field(
        None, ge=1, description="seq_mean_token_sum_norm: fixed length normaliser L (None = the padded length)"
    )
    scale_factor: float = Field(1.0, gt=0, description="constant multiplier of the total loss")
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "abs", "k1_plus", "k2_plus", "k3_plus", "abs_plus"] = Field(
        "k2", description="KL to the reference in the loss; k2's gradient is the KL's (seed 000; verl: low_var_kl = k3)"
    )
    entropy_coef: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _sequence_level_defaults(self) -> LossConfig:
        """GSPO's/GMPO's defaults differ from PPO's; an explicit token_mean GSPO is the field-facts #12 bug."""
        if self.type == "sapo" and "aggregation" not in self.model_fields_set:
            self.__dict__["aggregation"] = "seq_mean_token_mean"  # SAPO's (and verl's) sequence-mean objective
        if self.type not in SEQUENCE_LEVEL_LOSSES:
            return self
        given = self.model_fields_set
        if "aggregation" in given and self.aggregation == "token_mean":
            raise ValueError(
                f"loss.aggregation='token_mean' with loss.type={self.type!r} weighs long sequences more; GSPO "
                "averages each sequence's token log-ratio, then sequences: use 'seq_mean_token_mean'"
            )
        # Write through __dict__: these are defaults, not user assignments (keeps model_fields_set honest).
        if "aggregation" not in given:
            self.__dict__["aggregation"] = "seq_mean_token_mean"
        # GSPO paper: sequence ratios live within ~1e-3 of 1; GMPO paper: log-space bounds ±0.4
        lo, hi = (0.4, 0.4) if self.type == "gmpo" else (3e-4, 4e-4)
        if "clip_low" not in given:
            self.__dict__["clip_low"] = lo
        if "clip_high" not in given:
            self.__dict__["clip_high"] = hi
        return self


class AdvantageConfig(Section):
    estimator: Literal[
        "grpo", "grpo_no_std", "rloo", "reinforce_pp", "reinforce_pp_baseline", "opo", "vcpo_opob",
    ] = "grpo"  # fmt: skip
    eps: float = Field(1e-6, gt=0, description="GRPO: A = (r - mean) / (std + eps); REINFORCE++ whitening uses var + 1e-8")


class OptimConfig(Section):
    optimizer: Literal["adam"] = "adam"
    lr: float = Field(1e-3, gt=0)
    min_lr: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    ess_lr_scaling: bool = Field(False, description="VCPO: scale each step's lr by clamp(sqrt(ESS/N), min, 1)")
    ess_lr_min_scale: float = Field(0.1, gt=0, le=1, description="lower clamp of the VCPO lr multiplier")
