"""The ``data`` (prompt datasets) and ``reward`` sections of an experiment (docs/data.md).

Owns the keys and their per-field checks; files, rows and tokenizers are checked by the
preflight (``moe_rl.preflight``), the behaviour lives in ``moe_rl.data`` and ``moe_rl.reward``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from moe_rl.config.section import Section

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataConfig(Section):
    """Prompt datasets read from local files (never the hub); the tokenizer is ``model.hf_path``'s."""

    train_files: list[str] = Field(min_length=1, description=".jsonl / .json / .parquet files, read in order")
    eval_files: list[str] = Field(default_factory=list, description="held-out prompts (same keys)")
    prompt_key: str = Field("prompt", description="a string prompt, or a list of chat messages [{role, content}]")
    label_key: str = Field("label", description="the ground truth handed to the reward; dotted for nested fields")
    apply_chat_template: bool = Field(
        True, description="tokenizer.apply_chat_template(messages, add_generation_prompt=True)"
    )
    system_prompt: str | None = Field(None, description="prepended as a system message (a row's own system turn wins)")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra variables for the chat template, e.g. {enable_thinking: false} for "
        "Qwen3 (verl: data.apply_chat_template_kwargs)",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="a longer prompt is skipped when drawn (default: model.seq_length - max_new_tokens)"
    )
    overlong_prompts: Literal["drop", "error"] = "drop"
    shuffle: bool = Field(True, description="seeded by train.seed, reshuffled every epoch")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        fixed = sorted(set(kwargs) & {"conversation", "add_generation_prompt", "tokenize", "return_dict"})
        if fixed:
            raise ValueError(
                f"data.chat_template_kwargs sets {fixed}, which moe_rl fixes (the prompt ids are "
                "apply_chat_template(messages, add_generation_prompt=True, tokenize=True)); drop them"
            )
        return kwargs

    @field_validator("train_files", "eval_files")
    @classmethod
    def _suffixes(cls, files: list[str]) -> list[str]:
        for f in files:
            if not f.endswith(DATA_SUFFIXES):
                raise ValueError(f"data file {f!r} must end with one of {list(DATA_SUFFIXES)}")
        return files


class OverlongBufferConfig(Section):
    """DAPO's soft overlong punishment (verl ``reward_model.overlong_buffer``): a response longer than
    ``rollout.max_new_tokens - length`` loses ``penalty`` x (excess / length), up to ``penalty``."""

    length: int = Field(ge=1, description="the buffer: tokens before rollout.max_new_tokens where the penalty ramps")
    penalty: float = Field(1.0, ge=0.0, description="the penalty at rollout.max_new_tokens (verl penalty_factor)")


class RewardConfig(Section):
    """How finished samples are scored (``moe_rl.reward``)."""

    type: Literal["task", "math", "exact_match", "custom"] = Field(
        "task", description="task = the built-in digit task's scorer (train.task)"
    )
    function: str | None = Field(
        None,
        description="custom: 'pkg.module:fn' or 'path/to/file.py:fn', called as "
        "fn(data_source=, solution_str=, ground_truth=, extra_info=) -> float | {'score': float, ...}",
    )
    math_mode: Literal["strict", "flexible"] = Field(
        "strict",
        description="math: strict = only the last \\boxed{} or 'Answer:' line in the response's tail counts "
        "(verl math_dapo); flexible = else the last number too (verl gsm8k method='flexible')",
    )
    timeout_s: float = Field(30.0, gt=0, description="per sample, measured in the worker from the call's own start")
    num_workers: int = Field(2, ge=1, description="reward worker processes")
    overlong_buffer: OverlongBufferConfig | None = Field(
        None, description="DAPO overlong shaping: {length, penalty}, added to every sample's reward"
    )
    on_error: Literal["raise", "zero"] = Field(
        "raise",
        description="a reward that raises, times out or returns NaN: stop with an error, or score 0 and count it",
    )
