"""Config sections of running an experiment: ``train`` (with ``warm_start``), ``logging``, ``checkpoint``, ``launch``.

Owns how many steps of what size, where a run writes and resumes, and the SLURM layout it launches
with. Each section checks itself; rules across sections live in ``moe_rl.config.schema``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from moe_rl.config.section import Section

__all__ = ["CheckpointConfig", "LoggingConfig", "SlurmConfig", "TrainConfig", "WarmStartConfig"]


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
        1.0,
        gt=0,
        description="the warm-started policy is the SFT policy at this temperature (output layer / T); "
        "> 1 leaves it under-confident: its greedy answer right, its samples often wrong, so RL has room",
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
        False,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal and generate more prompts "
        "until prompts_per_step informative groups are collected",
    )
    max_generation_rounds: int = Field(
        10, ge=1, description="filter_groups: generation rounds per step before giving up"
    )
    filter_groups_fallback: bool = Field(
        False,
        description="filter_groups: when max_generation_rounds is reached, fill the batch with dropped groups "
        "(counted) instead of failing",
    )
    mask_truncated: bool = Field(False, description="drop responses that hit rollout.max_new_tokens from the loss")
    rollout_mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: generate, then train, then sync; async: a producer on rank 0 generates the next "
        "steps' batches while the learner trains (docs/training.md, 'sync -> async')",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="async: a batch for RL step s is generated only by weights of version >= s - k, and "
        "no sample older than that is trained on (0 = sync, step for step)",
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
        None,
        description="HF checkpoint dir the initial weights come from (default: model.hf_path); architecture "
        "and tokenizer still come from the model section",
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
        80.0,
        gt=0,
        description="memory of one learner GPU (GB = 1e9 bytes): the job plan refuses a layout whose GPU total "
        "(state, FP8 caches, activations, logits, CUDA/NCCL overhead) exceeds it (moe_rl.sizing)",
    )
    host_memory_gb: float | None = Field(
        None,
        gt=0,
        description="host memory of one learner node (GB = 1e9 bytes): the job plan refuses a layout whose host "
        "total per node exceeds it (moe_rl.sizing); None = unchecked",
    )
    fs_bandwidth_gb_s: float = Field(
        2.0,
        gt=0,
        description="shared-filesystem bandwidth of one node, GB/s: the job plan's times to load the HF "
        "checkpoint and to write a save",
    )
    network_bandwidth_gb_s: float = Field(
        25.0,
        gt=0,
        description="network bandwidth of one node (one 200 Gb/s NIC = 25 GB/s): the job plan's weight-sync time",
    )
    signal: Literal["USR1", "USR2"] | None = Field(
        "USR1",
        description="the warning SLURM sends signal_lead_s before the time limit (sbatch --signal=B:SIG@s); "
        "the learner finishes its step, checkpoints and the job requeues itself; None = no warning (SIGTERM is "
        "not one: scancel sends it too, to every process at once)",
    )
    signal_lead_s: int | None = Field(
        None,
        ge=10,
        description="seconds between the warning and the time limit: one step, a checkpoint and stopping the "
        "servers must fit (the preflight refuses less than the job plan's step + save + stop); None = that sum "
        "(moe_rl.sizing.defaults)",
    )
