"""Typed schema of one moe_rl experiment: every section a YAML file may hold.

Owns field names, types, defaults and cross-field coherence rules. Field names
mirror Megatron-Core's ``TransformerConfig`` where one exists, so a Megatron
user reads them without a glossary. It must not import torch or Megatron.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments re-validate."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FP8Config(Section):
    """Transformer Engine FP8 training (GPU only; rejected at build time without TE)."""

    format: Literal["e4m3", "hybrid"] = "e4m3"
    recipe: Literal["delayed", "tensorwise", "blockwise"] = "blockwise"
    amax_history_len: int = Field(1024, ge=1)
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    param_gather: bool = False


class ModelConfig(Section):
    """Decoder-only MoE transformer (Qwen3-MoE / DeepSeek-V3 family), Megatron names."""

    num_layers: int = Field(2, ge=1)
    hidden_size: int = Field(64, ge=1)
    ffn_hidden_size: int = Field(128, ge=1, description="dense MLP width (dense layers only)")
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: int = Field(2, ge=1, description="GQA key/value heads")
    kv_channels: int = Field(16, ge=1, description="head dim")
    qk_layernorm: bool = True
    vocab_size: int = Field(512, ge=2)
    seq_length: int = Field(256, ge=2, description="max positions (prompt + response)")
    rotary_base: float = Field(1_000_000.0, gt=0)
    rotary_percent: float = Field(1.0, gt=0, le=1, description="fraction of each head dim that gets RoPE (GLM-4.5: 0.5)")
    add_qkv_bias: bool = Field(False, description="bias on the q/k/v projections (GLM-4.5: true)")
    layernorm_epsilon: float = Field(1e-6, gt=0)
    init_method_std: float = Field(0.02, gt=0)
    num_moe_experts: int = Field(8, ge=1)
    moe_router_topk: int = Field(2, ge=1)
    moe_ffn_hidden_size: int = Field(32, ge=1)
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_enable_expert_bias: bool = False
    moe_router_num_groups: int | None = Field(None, ge=1)
    moe_router_group_topk: int | None = Field(None, ge=1)
    moe_router_topk_scaling_factor: float | None = Field(None, gt=0)
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    moe_aux_loss_coeff: float = Field(0.0, ge=0)
    moe_z_loss_coeff: float | None = Field(None, ge=0)
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "sinkhorn", "none"] = "aux_loss"
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "alltoall"
    moe_expert_capacity_factor: float | None = Field(None, gt=0)
    moe_router_fusion: bool = False
    moe_layer_freq: int | list[Literal[0, 1]] = 1
    first_k_dense_layers: int = Field(0, ge=0)
    mtp_num_layers: int = Field(0, ge=0)
    moe_shared_expert_intermediate_size: int | None = Field(None, ge=1, description="shared experts' total width")
    hf_architecture: Literal["Qwen3MoeForCausalLM", "Glm4MoeForCausalLM"] = Field(
        "Qwen3MoeForCausalLM", description="HF format for init_from_hf and weight sync to SGLang"
    )

    def moe_layer_pattern(self) -> list[int]:
        """Per decoder layer 1 = MoE, 0 = dense, combining moe_layer_freq and first_k_dense_layers."""
        if isinstance(self.moe_layer_freq, list):
            pattern = list(self.moe_layer_freq)
        else:
            pattern = [1 if i % self.moe_layer_freq == 0 else 0 for i in range(self.num_layers)]
        for i in range(min(self.first_k_dense_layers, self.num_layers)):
            pattern[i] = 0
        return pattern

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern())

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"model.moe_router_topk={self.moe_router_topk} must be <= model.num_moe_experts={self.num_moe_experts}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_query_groups={self.num_query_groups} must divide "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if isinstance(self.moe_layer_freq, list) and len(self.moe_layer_freq) != self.num_layers:
            raise ValueError(
                f"model.moe_layer_freq has {len(self.moe_layer_freq)} entries; expected one per layer "
                f"(model.num_layers={self.num_layers})"
            )
        if isinstance(self.moe_layer_freq, int) and self.moe_layer_freq < 1:
            raise ValueError(f"model.moe_layer_freq={self.moe_layer_freq} must be >= 1 or a 0/1 list")
        if self.num_moe_layers == 0:
            raise ValueError("model has no MoE layer (moe_layer_freq / first_k_dense_layers leave none)")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ValueError("model.moe_router_num_groups and model.moe_router_group_topk must be set together")
        if groups is not None:
            if self.num_moe_experts % groups:
                raise ValueError(f"model.moe_router_num_groups={groups} must divide num_moe_experts={self.num_moe_experts}")
            if group_topk > groups:
                raise ValueError(f"model.moe_router_group_topk={group_topk} must be <= moe_router_num_groups={groups}")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("model.moe_router_enable_expert_bias requires model.moe_router_score_function='sigmoid'")
        if self.num_moe_experts > 65536:
            raise ValueError(f"model.num_moe_experts={self.num_moe_experts} exceeds the 65536 a uint16 route holds")
        return self


class ParallelConfig(Section):
    """Megatron-Core parallel sizes for the learner."""

    tp: int = Field(1, ge=1, description="tensor_model_parallel_size")
    pp: int = Field(1, ge=1, description="pipeline_model_parallel_size")
    ep: int = Field(1, ge=1, description="expert_model_parallel_size")
    cp: int = Field(1, ge=1, description="context_parallel_size")
    etp: int | None = Field(None, ge=1, description="expert_tensor_parallel_size (None: same as tp)")
    backend: Literal["auto", "gloo", "nccl"] = "auto"


class PrecisionConfig(Section):
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    fp8: FP8Config | None = None


ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"  # an environment variable name


class RolloutConfig(Section):
    """SGLang rollout engine: where it is (or how to launch it) and how it samples."""

    addresses: list[str] = Field(default_factory=list, description="http://host:port of running servers; empty = launch")
    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=1, le=65535, description="None = pick a free port")
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["bfloat16", "float32"] = "float32"
    weight_quantization: Literal["none", "fp8_e4m3", "fp8_e5m2"] = "none"
    weight_sync: Literal["auto", "tensor", "disk"] = Field(
        "auto",
        description="learner -> server weights: tensor = shared-memory tensors over /update_weights_from_tensor "
        "(servers on this host); disk = exported HF dir over /update_weights_from_disk; auto = tensor when every "
        "server is on this host, else disk",
    )
    weight_sync_bucket_mb: int = Field(256, ge=1, description="tensor sync: MiB of weights per request")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 = no top-k")
    max_new_tokens: int = Field(16, ge=1)
    samples_per_prompt: int = Field(4, ge=1)
    deterministic: bool = True
    seed: int = 0
    sampling_mask_max_tokens: int = Field(4096, ge=1)
    request_timeout_s: float = Field(120.0, gt=0)
    startup_timeout_s: float = Field(180.0, gt=0)
    max_concurrency: int = Field(16, ge=1)
    sleep_on_idle: bool = Field(
        True, description="SGLang's --sleep-on-idle: an idle scheduler waits on its sockets instead of spinning a "
        "core (it took 65-95% of a core from a co-located learner on 2 cores)"
    )
    max_retries: int = Field(3, ge=0)
    mem_fraction_static: float = Field(0.05, gt=0, le=1)
    max_total_tokens: int = Field(4096, ge=16)
    extra_server_args: list[str] = Field(default_factory=list)
    api_key_env: str | None = Field(
        None, pattern=ENV_NAME, description="name of the environment variable holding the API key (never the key)"
    )
    admin_api_key_env: str | None = Field(
        None, pattern=ENV_NAME, description="name of the variable holding SGLang's admin key (for weight updates)"
    )
    health_timeout_s: float = Field(30.0, gt=0, le=600, description="a server silent this long counts as hung")
    max_server_restarts: int = Field(2, ge=0, description="restarts of a dead server this run launched")


class ReplayConfig(Section):
    routing: Literal["none", "r2", "r3"] = "none"
    keep_sampling_mask: bool = False


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
    kl_cov_coef: float = Field(1.0, ge=0, description="KL-Cov beta on |log r|")
    aggregation: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum", "seq_mean_token_sum",
    ] = "token_mean"  # fmt: skip
    norm_len: int | None = Field(
        None, ge=1, description="seq_mean_token_sum_norm: fixed length normaliser L (None = the padded length)"
    )
    scale_factor: float = Field(1.0, gt=0, description="constant multiplier of the total loss")
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "abs", "k1_plus", "k2_plus", "k3_plus", "abs_plus"] = "k3"
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
    eps: float = Field(1e-6, gt=0)


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


class WarmStartConfig(Section):
    """Supervised warm start before RL: teacher forcing on the task's correct answers (moe_rl.train.warm_start).

    Independent of ``train.seed``, so every seed / ablation cell starts from the same policy; the
    result is cached as safetensors under ``cache_dir``, keyed by the config hash and code version.
    """

    steps: int = Field(40, ge=1, description="optimizer steps of the supervised phase")
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(32, ge=1, description="prompts (with their correct answers) per step")
    seed: int = Field(0, description="model init and prompt sampling of the warm start")
    temperature: float = Field(
        1.0, gt=0, description="the warm-started policy is the SFT policy at this temperature (output layer / T); "
        "> 1 leaves it under-confident: its greedy answer right, its samples often wrong, so RL has room"
    )
    cache_dir: str = Field("~/.cache/moe_rl/warm_start", description="where the cached warm-start weights live")


class TrainConfig(Section):
    steps: int = Field(10, ge=1)
    prompts_per_step: int = Field(8, ge=1)
    minibatches_per_step: int = Field(1, ge=1, description="N: optimizer steps per rollout batch")
    epochs_per_step: int = Field(1, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    recompute: Literal["none", "full"] = "none"
    seed: int = 1234
    task: str = "reverse"
    reward_fn: str | None = Field(None, description="'module:function' overriding the task's reward")
    output_dir: str = "runs/default"
    rollouts_from: str | None = Field(
        None, description="train on saved records DIR/step_<s>.safetensors instead of generating (no server)"
    )
    warm_start: WarmStartConfig | None = Field(None, description="supervised phase before RL; None = start from init")


class LoggingConfig(Section):
    jsonl: bool = True
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "moe_rl"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    progress: bool = True


class CheckpointConfig(Section):
    dir: str | None = Field(None, description="None = <train.output_dir>/checkpoints")
    save_interval: int = Field(0, ge=0, description="0 = only at the end")
    keep_last: int = Field(2, ge=1)
    resume: Literal["auto", "never"] = "auto"
    init_from_hf: str | None = Field(None, description="HF checkpoint dir to initialise the learner from")
    overwrite: bool = Field(False, description="with resume=never: discard a previous run in train.output_dir")
    allow_changes: list[str] = Field(
        default_factory=list, description="config keys (or 'section.*') allowed to differ from the run being resumed"
    )


class SlurmConfig(Section):
    rollout_nodes: int = Field(1, ge=0)
    learner_nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    rollout_port: int = Field(30000, ge=1, le=65535)
    master_port: int = Field(29500, ge=1, le=65535)
    partition: str | None = None
    time: str = "24:00:00"


class ExperimentConfig(Section):
    """A whole experiment; each section validated on its own, then together."""

    name: str = "experiment"
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    launch: SlurmConfig = Field(default_factory=SlurmConfig)
    grid: dict[str, Any] | None = Field(None, description="ablation grid: config key -> values, checked by moe-rl ablate")

    @model_validator(mode="after")
    def _check_coherence(self) -> ExperimentConfig:
        m, p = self.model, self.parallel
        if m.num_moe_experts % p.ep:
            raise ValueError(f"parallel.ep={p.ep} must divide model.num_moe_experts={m.num_moe_experts}")
        if m.num_attention_heads % p.tp or m.num_query_groups % p.tp:
            raise ValueError(
                f"parallel.tp={p.tp} must divide model.num_attention_heads={m.num_attention_heads} "
                f"and model.num_query_groups={m.num_query_groups}"
            )
        if m.num_layers % p.pp:
            raise ValueError(f"parallel.pp={p.pp} must divide model.num_layers={m.num_layers}")
        if self.replay.routing == "r2" and self.correction.mode == "bypass":
            raise ValueError(
                "replay.routing='r2' records the learner's old-policy routes, which bypass mode never computes; "
                "use correction.mode='decoupled' or replay.routing in {'none', 'r3'}"
            )
        if self.replay.routing != "none":
            if m.moe_router_fusion:
                raise ValueError("model.moe_router_fusion=true bypasses router replay; set it false or replay.routing='none'")
            if m.moe_router_load_balancing_type == "sinkhorn":
                raise ValueError("model.moe_router_load_balancing_type='sinkhorn' bypasses router replay")
            if m.moe_expert_capacity_factor is not None:
                raise ValueError(
                    "model.moe_expert_capacity_factor drops tokens, including replayed assignments; "
                    "set it null (dropless) when replay.routing != 'none'"
                )
        if self.train.prompts_per_step * self.rollout.samples_per_prompt % self.train.minibatches_per_step:
            raise ValueError(
                f"train.minibatches_per_step={self.train.minibatches_per_step} must divide the rollout batch "
                f"(train.prompts_per_step * rollout.samples_per_prompt = "
                f"{self.train.prompts_per_step * self.rollout.samples_per_prompt})"
            )
        if self.rollout.top_k != -1 and self.rollout.top_k > m.vocab_size:
            raise ValueError(f"rollout.top_k={self.rollout.top_k} must be -1 or <= model.vocab_size={m.vocab_size}")
        return self
