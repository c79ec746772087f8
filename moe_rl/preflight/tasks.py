"""Preflight config rules of the built-in synthetic tasks: ``train.task`` and ``train.reward_fn``.

Owns what the task side would refuse at its first prompt: an unknown task, a task vocabulary that does
not fit ``model.vocab_size``, prompt + response longer than ``model.seq_length``, and a reward function
that does not import. Rules yield messages naming the dotted key (docs/configs.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from moe_rl.config import ExperimentConfig
from moe_rl.tasks.synthetic import KNOWN_TASKS, DigitTask, load_reward_fn

__all__ = ["reward_fn_imports", "task_and_lengths"]


def task_and_lengths(cfg: ExperimentConfig) -> Iterable[str]:
    """The task exists, its vocabulary fits the model, and prompt + response fit model.seq_length."""
    t, m, r = cfg.train, cfg.model, cfg.rollout
    if cfg.data is not None:  # prompts come from data.train_files (moe_rl.preflight.data)
        return
    if t.task not in KNOWN_TASKS:
        yield f"train.task={t.task!r} is not a known task; expected one of {sorted(KNOWN_TASKS)}"
        return
    try:
        task = DigitTask(t.task, m.vocab_size)
    except ValueError as exc:  # the task vocabulary does not fit model.vocab_size
        yield str(exc)
        return
    prompt_len = len(task.make_prompt([1] * task.digit_range[1]).ids)  # the longest prompt
    if prompt_len + r.max_new_tokens > m.seq_length:
        room = m.seq_length - prompt_len
        fix = f"rollout.max_new_tokens <= {room} or " if room >= 1 else ""
        yield (
            f"rollout.max_new_tokens={r.max_new_tokens} plus the {prompt_len}-token prompt of train.task={t.task!r} "
            f"exceeds model.seq_length={m.seq_length}; expected {fix}model.seq_length >= {prompt_len + r.max_new_tokens}"
        )


def reward_fn_imports(cfg: ExperimentConfig) -> Iterable[str]:
    if cfg.train.reward_fn is None:
        return
    try:
        load_reward_fn(cfg.train.reward_fn)
    except ValueError as exc:
        yield str(exc)
    except Exception as exc:  # noqa: BLE001 -- a user module failing at import time: report, do not crash
        yield f"train.reward_fn={cfg.train.reward_fn!r} raised {type(exc).__name__} on import: {exc}"
