"""The ``eval`` section: held-out evaluation during training (``moe_rl.source.evaluate``).

Owns its keys and their per-field checks. What is evaluated: each ``data.eval_files`` file (named by
its stem), or, for the built-in digit tasks, held-out prompts of ``train.task`` (named ``task``).
"""

from __future__ import annotations

from pydantic import Field

from moe_rl.config.section import Section


class EvalConfig(Section):
    """Periodic held-out evaluation: reward mean, pass@1 and pass@k per eval set (docs/data.md)."""

    interval: int = Field(
        5,
        ge=0,
        description="RL steps between evaluations; also before the first step and after the last (0 = only those)",
    )
    samples_per_prompt: int = Field(4, ge=1, description="k of pass@k: samples drawn per eval prompt")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature of eval generations; 0 = greedy")
    max_prompts: int | None = Field(None, ge=1, description="first N prompts of each eval set (None = all)")
    pass_threshold: float = Field(1.0, description="a sample counts as correct for pass@k when its reward >= this")
    task_prompts: int = Field(32, ge=1, description="built-in tasks only: held-out prompts drawn from train.task")


def eval_and_filters(cfg):
    """Preflight rule: what the ``eval`` section, the group filters and overlong shaping need."""
    e, t, r = cfg.eval, cfg.train, cfg.rollout
    if e is not None and cfg.data is not None and not cfg.data.eval_files:
        yield (
            "eval.interval is set but data.eval_files is empty: with a data section the eval sets are its "
            "eval_files (set data.eval_files=[FILE, ...], or drop the eval section)"
        )
    if e is not None and t.rollouts_from:
        yield "eval needs the rollout servers; train.rollouts_from trains on saved records without them (drop eval)"
    if t.filter_groups and r.samples_per_prompt < 2:
        yield (
            f"train.filter_groups=true with rollout.samples_per_prompt={r.samples_per_prompt}: a group of one "
            "sample always has equal rewards; expected samples_per_prompt >= 2"
        )
    if t.filter_groups and t.rollouts_from:
        yield "train.filter_groups=true filters groups while generating; train.rollouts_from trains on saved records"
    ob = cfg.reward.overlong_buffer
    if ob is not None and ob.length > r.max_new_tokens:
        yield (
            f"reward.overlong_buffer.length={ob.length} exceeds rollout.max_new_tokens={r.max_new_tokens}; "
            "expected a buffer inside the response budget"
        )
