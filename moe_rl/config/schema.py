"""Typed schema of one moe_rl experiment: ``ExperimentConfig``, every section a YAML file may hold.

Owns the whole experiment and the cross-section coherence rules; each section lives in its own module
and checks itself: ``model_sections`` (model, parallel, precision), ``rollout_sections`` (rollout,
replay), ``algo_sections`` (correction, loss, advantage, optim), ``data_sections`` (data, reward),
``eval_section`` and ``run_sections`` (train, logging, checkpoint, launch). It must not import torch
or Megatron.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from moe_rl.config.algo_sections import AdvantageConfig, CorrectionConfig, LossConfig, OptimConfig
from moe_rl.config.data_sections import DataConfig, RewardConfig
from moe_rl.config.eval_section import EvalConfig
from moe_rl.config.model_sections import ModelConfig, ParallelConfig, PrecisionConfig
from moe_rl.config.rollout_sections import ReplayConfig, RolloutConfig, replay_correction_problem
from moe_rl.config.run_sections import CheckpointConfig, LoggingConfig, SlurmConfig, TrainConfig
from moe_rl.config.section import Section

__all__ = ["ExperimentConfig"]


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
    grid: dict[str, Any] | None = Field(
        None, description="ablation grid: config key -> values, checked by moe-rl ablate"
    )

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
        if (problem := replay_correction_problem(self.replay.routing, self.correction.mode)) is not None:
            raise ValueError(problem)
        if self.replay.routing != "none":
            if m.moe_router_fusion:
                raise ValueError(
                    "model.moe_router_fusion=true bypasses router replay; set it false or replay.routing='none'"
                )
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
        stages = self.rollout.weight_sync_stage_addresses
        if stages is not None and (len(stages) != p.pp or not all(a.strip() for a in stages)):
            raise ValueError(
                f"rollout.weight_sync_stage_addresses={stages} must name one address per pipeline stage "
                f"(parallel.pp={p.pp})"
            )
        if stages is not None and self.rollout.weight_sync_master_address is not None:
            raise ValueError(
                "rollout.weight_sync_stage_addresses and rollout.weight_sync_master_address are both set; "
                "set one (the list names every stage's address)"
            )
        if self.rollout.top_k != -1 and self.rollout.top_k > m.vocab_size:
            raise ValueError(f"rollout.top_k={self.rollout.top_k} must be -1 or <= model.vocab_size={m.vocab_size}")
        return self
