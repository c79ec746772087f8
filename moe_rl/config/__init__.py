"""Experiment configuration: typed schema (``schema``) and YAML loading (``loader``)."""

from moe_rl.config.loader import (
    ConfigError,
    apply_overrides,
    dump_config,
    load_config,
    load_yaml_tree,
    save_config,
    validate_tree,
)
from moe_rl.config.schema import (
    AdvantageConfig,
    CheckpointConfig,
    CorrectionConfig,
    ExperimentConfig,
    FP8Config,
    LoggingConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    ReplayConfig,
    RolloutConfig,
    SlurmConfig,
    TrainConfig,
)

__all__ = [
    "AdvantageConfig", "CheckpointConfig", "ConfigError", "CorrectionConfig", "ExperimentConfig",
    "FP8Config", "LoggingConfig", "LossConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
    "PrecisionConfig", "ReplayConfig", "RolloutConfig", "SlurmConfig", "TrainConfig",
    "apply_overrides", "dump_config", "load_config", "load_yaml_tree", "save_config", "validate_tree",
]
