"""Typed schema of one moe_rl experiment: every section a YAML file may hold.

Owns the model, parallel, precision, rollout, replay and run sections (the algorithm's sections
live in ``algo_sections`` and are re-exported here), and the cross-section coherence rules of
``ExperimentConfig``. Field names
mirror Megatron-Core's ``TransformerConfig`` where one exists, so a Megatron
user reads them without a glossary. It must not import torch or Megatron.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from moe_rl.config.algo_sections import (  # noqa: F401  (re-exported: the schema is every section)
    SEQUENCE_LEVEL_LOSSES,
    AdvantageConfig,
    CorrectionConfig,
    LossConfig,
    OptimConfig,
    RejectionCriterion,
    RejectionMode,
)
from moe_rl.config.data_sections import DataConfig, RewardConfig  # noqa: F401  (re-exported)
from moe_rl.config.eval_section import EvalConfig  # noqa: F401  (re-exported)
from moe_rl.config.section import Section
from moe_rl.config.kernels import KERNELS

ExactKernel = Literal[tuple(KERNELS)]  # the items of the true-on-policy kernel contract


class FP8Config(Section):
    """Transformer Engine FP8 training (GPU only; rejected at build time without TE)."""

    format: Literal["e4m3", "hybrid"] = "e4m3"
    recipe: Literal["delayed", "tensorwise", "blockwise"] = "blockwise"
    amax_history_len: int = Field(1024, ge=1)
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    param_gather: bool = False


class ModelConfig(Section):
    """Decoder-only MoE transformer (Qwen3-MoE / DeepSeek-V3 family), Megatron names.

    With ``hf_path`` every architecture key not given explicitly is read from ``hf_path/config.json``
    (``moe_rl.config.hf_model``); an explicit key that disagrees is refused by the preflight.
    """

    hf_path: str | None = Field(
        None, description="Hugging Face model directory: architecture (config.json), initial weights and tokenizer"
    )
    build_command: str | None = Field(
        None, description="the command that creates model.hf_path on a fresh clone (e.g. 'make math-example'): "
        "config validate names it and checks the rest while the directory is missing; not part of the architecture"
    )
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

    @model_validator(mode="before")
    @classmethod
    def _fill_from_hf(cls, data):
        """Keys not given explicitly come from ``hf_path/config.json`` (unreadable: the preflight says why)."""
        if not isinstance(data, dict) or not data.get("hf_path"):
            return data
        from moe_rl.config.hf_model import HFModelError, model_keys_from_hf, read_hf_config

        try:
            derived = model_keys_from_hf(read_hf_config(data["hf_path"]), str(data["hf_path"]))
        except HFModelError:
            return data
        return {**derived, **data}

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
    deterministic: bool = Field(
        False, description="CUDA learner: deterministic kernels (torch.use_deterministic_algorithms, warning for ops "
        "without one; CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set; Megatron's deterministic_mode, with "
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 for Transformer Engine's attention), so a resumed run repeats a straight "
        "one bit for bit. The CPU learner is deterministic without it"
    )


ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"  # an environment variable name


class RolloutConfig(Section):
    """SGLang rollout engine: where it is (or how to launch it) and how it samples."""

    addresses: list[str] = Field(default_factory=list, description="http://host:port of running servers; empty = launch")
    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=1, le=65535, description="None = pick a free port")
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["bfloat16", "float32"] = "float32"
    weight_quantization: Literal["none", "fp8_e4m3", "fp8_e5m2"] = "none"
    weight_sync: Literal["auto", "tensor", "disk", "distributed"] = Field(
        "auto",
        description="learner -> server weights: tensor = shared-memory tensors over /update_weights_from_tensor "
        "(servers on this host); disk = exported HF dir over /update_weights_from_disk; distributed = a broadcast "
        "from the learner's rank 0 into a process group with the servers (/update_weights_from_distributed); "
        "auto = tensor when every server is on this host, else disk",
    )
    weight_sync_bucket_mb: int = Field(256, ge=1, description="tensor and distributed sync: MiB of weights per request")
    weight_sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="distributed sync: the group's backend; auto = nccl for rollout.device cuda, else gloo"
    )
    weight_sync_master_address: str | None = Field(
        None, description="distributed sync: the address the servers reach the learner's rank 0 at (SGLang's "
        "master_address); None = loopback when every server is on this host, else this host's address on the route "
        "to the first server"
    )
    weight_sync_master_port: int | None = Field(
        None, ge=1, le=65535, description="distributed sync: the rendezvous port rank 0 listens on (SGLang's "
        "master_port; must be free and reachable from the servers); None = a free port"
    )
    partial: bool = Field(
        False, description="partial rollouts (async mode): a weight update pauses in-flight requests "
        "(rollout.pause_mode) instead of waiting for them, so a response can span weight versions"
    )
    pause_mode: Literal["retract", "abort", "in_place"] = Field(
        "retract", description="rollout.partial: retract / abort re-prefill under the new weights (exact per-token "
        "versions); in_place keeps the old-weight prefix KV (approximate, counted as async/kv_stale_tokens)"
    )
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 = no top-k")
    max_new_tokens: int = Field(16, ge=1)
    samples_per_prompt: int = Field(4, ge=1)
    deterministic: bool = True
    true_on_policy: bool = Field(
        False, description="exact-zero mismatch (miles' --true-on-policy-mode): the SGLang CPU server and the "
        "learner compute every forward with the shared row-invariant kernels of moe_rl.exact, so the learner "
        "recomputes each rollout log-prob and router top-k bit for bit (docs/true_on_policy.md); slow"
    )
    true_on_policy_kernels: list[ExactKernel] | None = Field(
        None, description="with true_on_policy: the items of the kernel contract to share (moe_rl.config.kernels; "
        "default all). A subset is not exact: `moe-rl diagnose --attribute` uses it to measure each item alone"
    )
    seed: int = 0
    sampling_mask_max_tokens: int = Field(4096, ge=1)
    request_timeout_s: float = Field(120.0, gt=0)
    startup_timeout_s: float = Field(180.0, gt=0)
    max_concurrency: int = Field(
        16, ge=1, description="requests in flight from the rollout client, all servers and all steps in flight "
        "together (async: a freed slot goes to the oldest step's request)"
    )
    sleep_on_idle: bool = Field(
        True, description="SGLang's --sleep-on-idle: an idle scheduler waits on its sockets instead of spinning a "
        "core (it took 65-95% of a core from a co-located learner on 2 cores)"
    )
    server_cpus: list[int] = Field(
        default_factory=list, description="CPU cores the servers this run launches are pinned to "
        "(sched_setaffinity; e.g. the rollout cores of a node shared with the learner); [] = not pinned"
    )
    process_cpus: list[int] = Field(
        default_factory=list, description="train.rollout_mode=async: CPU cores of the rollout process (prompts, "
        "reply decoding, rewards, records); [] = the trainer's cores and rollout.server_cpus together (the OS runs it "
        "wherever one is free; docs/training.md)"
    )
    load_balance: Literal["least_outstanding", "round_robin"] = Field(
        "least_outstanding", description="which server a request goes to: the one with the fewest of the client's "
        "requests in flight (ties: round robin), or plain round robin (bench/bench_load_balance.py)"
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
    max_foreign_syncs: int = Field(
        2, ge=0, description="re-syncs in a row after a batch made under weights the trainer did not push (label "
        "or fingerprint); one more stops the run (exit code 2)"
    )


class ReplayConfig(Section):
    routing: Literal["none", "r2", "r3"] = "none"
    keep_sampling_mask: bool = False



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
    filter_groups: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal and generate more prompts "
        "until prompts_per_step informative groups are collected"
    )
    max_generation_rounds: int = Field(10, ge=1, description="filter_groups: generation rounds per step before giving up")
    filter_groups_fallback: bool = Field(
        False, description="filter_groups: when max_generation_rounds is reached, fill the batch with dropped groups "
        "(counted) instead of failing"
    )
    mask_truncated: bool = Field(False, description="drop responses that hit rollout.max_new_tokens from the loss")
    rollout_mode: Literal["sync", "async"] = Field(
        "sync", description="sync: generate, then train, then sync; async: a producer on rank 0 generates the next "
        "steps' batches while the learner trains (docs/training.md, 'sync -> async')"
    )
    max_staleness: int = Field(
        1, ge=0, description="async: a batch for RL step s is generated only by weights of version >= s - k, and "
        "no sample older than that is trained on (0 = sync, step for step)"
    )


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
    init_from_hf: str | None = Field(
        None, description="HF checkpoint dir the initial weights come from (default: model.hf_path); architecture "
        "and tokenizer still come from the model section"
    )
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
    gpu_memory_gb: float = Field(
        80.0, gt=0, description="memory of one learner GPU (GB = 1e9 bytes): the memory plan refuses a layout whose "
        "weights, gradients and optimizer state alone exceed it (moe_rl.config.memory_plan)"
    )
    signal: Literal["USR1", "USR2"] | None = Field(
        "USR1", description="the warning SLURM sends signal_lead_s before the time limit (sbatch --signal=B:SIG@s); "
        "the learner finishes its step, checkpoints and the job requeues itself; None = no warning (SIGTERM is "
        "not one: scancel sends it too, to every process at once)")
    signal_lead_s: int = Field(300, ge=10, description="seconds between the warning and the time limit: one step, "
                               "a checkpoint and stopping the servers must fit")


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
    data: DataConfig | None = Field(None, description="prompt datasets; None = the built-in task train.task")
    reward: RewardConfig = Field(default_factory=RewardConfig)
    eval: EvalConfig | None = Field(None, description="held-out evaluation during training; None = none")
    launch: SlurmConfig = Field(default_factory=SlurmConfig)
    grid: dict[str, Any] | None = Field(None, description="ablation grid: config key -> values, checked by moe-rl ablate")

    @property
    def ksm_is_noop(self) -> bool:
        """Keep Sampling Mask on untruncated sampling (top_p = 1, top_k <= 0): the kept set is the vocab."""
        r = self.rollout
        return self.replay.keep_sampling_mask and r.top_p >= 1.0 and r.top_k <= 0

    @property
    def ksm_active(self) -> bool:
        """Keep Sampling Mask requests masks and renormalises: on, and sampling truncates (else a no-op)."""
        return self.replay.keep_sampling_mask and not self.ksm_is_noop

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
