"""Scoring finished samples: the one reward interface the training loop calls.

Owns ``Rewarder.score(prompts, responses) -> Scores`` for every ``reward.type``:

* ``task`` -- the built-in digit task's scorer (or ``train.reward_fn``) in this process, exactly as
  before (it is cheap and deterministic, and the committed runs depend on it);
* ``math`` / ``exact_match`` / ``custom`` -- a function with verl's signature in the worker pool
  (``moe_rl.reward.pool``), called with ``solution_str`` = the response decoded with special tokens
  skipped, ``ground_truth`` = the row's label, and the row's ``data_source`` / ``extra_info``.

A call that raises, times out or returns NaN stops the run with one error naming the dataset file,
row and function, or with ``reward.on_error: zero`` is scored 0, counted (``reward/errors``) and logged.
Numeric keys a function returns next to ``score`` are averaged into ``reward/<key>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moe_rl.reward.custom import BUILTIN_FUNCTIONS
from moe_rl.reward.pool import RewardPool

__all__ = ["RewardError", "Rewarder", "Scores", "build_rewarder", "function_spec"]


class RewardError(RuntimeError):
    """A reward function failed on a sample; the message names the file, row and function."""


@dataclass
class Scores:
    rewards: list[float]
    metrics: dict[str, float] = field(default_factory=dict)


class Rewarder:
    """Base: ``score`` finished samples, ``close`` releases workers."""

    def score(self, prompts: Sequence, responses: Sequence[Sequence[int]]) -> Scores:
        raise NotImplementedError

    def close(self) -> None:
        return None


class TaskRewarder(Rewarder):
    """The built-in task's ``score(prompt, response_ids)`` (or ``train.reward_fn``), in process."""

    def __init__(self, fn):
        self.fn = fn

    def score(self, prompts, responses) -> Scores:
        return Scores([float(self.fn(p.task_prompt, list(np.asarray(r).tolist()))) for p, r in zip(prompts, responses)])


def function_spec(reward_cfg) -> str:
    """The ``'module:fn'`` / ``'file.py:fn'`` a pool-backed ``reward.type`` runs (``math`` per ``reward.math_mode``)."""
    if reward_cfg.type == "custom":
        return reward_cfg.function
    if reward_cfg.type == "math" and reward_cfg.math_mode == "flexible":
        return BUILTIN_FUNCTIONS["math_flexible"]
    return BUILTIN_FUNCTIONS[reward_cfg.type]


class PoolRewarder(Rewarder):
    """A verl-signature function in worker processes (``reward.timeout_s`` per call)."""

    def __init__(self, reward_cfg, tokenizer, log=print):
        self.spec, self.on_error, self.tokenizer, self.log = (
            function_spec(reward_cfg),
            reward_cfg.on_error,
            tokenizer,
            log,
        )
        self.pool = RewardPool(self.spec, reward_cfg.num_workers, reward_cfg.timeout_s)

    def calls(self, prompts, responses) -> list[dict]:
        """The keyword arguments of each call (verl's names)."""
        return [
            {
                "data_source": p.data_source,
                "solution_str": self.tokenizer.decode(list(np.asarray(r).tolist()), skip_special_tokens=True),
                "ground_truth": p.label,
                "extra_info": p.extra_info,
            }
            for p, r in zip(prompts, responses)
        ]

    def score(self, prompts, responses) -> Scores:
        try:  # start: imports the function in every worker (once); map: also in any replacement
            outcomes = self.pool.start().map(self.calls(prompts, responses))
        except (ValueError, RuntimeError) as exc:
            raise RewardError(str(exc)) from None
        errors = [(k, o.error) for k, o in enumerate(outcomes) if o.error is not None]
        if errors:
            k, why = errors[0]
            p = prompts[k]
            where = f"{p.file} row {p.row}" if p.file else f"sample {k}"
            message = f"reward function {self.spec!r} {why} on {where} (data_source={p.data_source!r})"
            if self.on_error == "raise":
                raise RewardError(
                    message + f"; {len(errors)} of {len(outcomes)} samples failed "
                    "(reward.on_error='zero' scores them 0 instead)"
                )
            if self.log is not None:
                self.log(
                    f"reward: {len(errors)} of {len(outcomes)} samples scored 0 (reward.on_error='zero'); "
                    f"first: {message}"
                )
        metrics = {"reward/errors": float(len(errors))}
        keys = sorted({key for o in outcomes for key in o.extras})
        for key in keys:
            values = [o.extras[key] for o in outcomes if key in o.extras]
            metrics[f"reward/{key}"] = float(np.mean(values))
        return Scores([0.0 if o.error is not None else o.score for o in outcomes], metrics)

    def close(self) -> None:
        self.pool.close()


def build_rewarder(cfg, tokenizer=None, log=print) -> Rewarder:
    """The scorer for ``cfg.reward`` (``task``: the built-in task, or ``train.reward_fn``)."""
    if cfg.reward.type == "task":
        from moe_rl.tasks.synthetic import build_task  # noqa: PLC0415  the task tokenizer imports transformers

        return TaskRewarder(build_task(cfg.train, cfg.model.vocab_size)[1])
    return PoolRewarder(cfg.reward, tokenizer, log=log)
