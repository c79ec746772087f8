"""Experiment configuration: typed schema (``schema`` and its section modules) and YAML loading (``loader``)."""

from moe_rl.config.algo_sections import AdvantageConfig, CorrectionConfig, LossConfig, OptimConfig
from moe_rl.config.loader import (
    ConfigError,
    apply_overrides,
    dump_config,
    load_config,
    load_yaml_tree,
    save_config,
    validate_tree,
)
from moe_rl.config.model_sections import FP8Config, ModelConfig, ParallelConfig, PrecisionConfig
from moe_rl.config.rollout_sections import ReplayConfig, RolloutConfig
from moe_rl.config.run_sections import CheckpointConfig, LoggingConfig, SlurmConfig, TrainConfig
from moe_rl.config.schema import ExperimentConfig

__all__ = [
    "AdvantageConfig",
    "CheckpointConfig",
    "ConfigError",
    "CorrectionConfig",
    "ExperimentConfig",
    "FP8Config",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "ReplayConfig",
    "RolloutConfig",
    "SlurmConfig",
    "TrainConfig",
    "apply_overrides",
    "dump_config",
    "load_config",
    "load_yaml_tree",
    "save_config",
    "validate_tree",
]
