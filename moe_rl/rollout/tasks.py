"""Synthetic tasks with verifiable rewards that a tiny model can learn on CPU, and user reward hooks.

Owns prompt generation (copy / reverse / sort / add / max over short digit strings)
and scoring. A prompt reads ``<bos> reverse : 3 1 4 >`` and the answer ``4 1 3 <eos>``.
Rewards are in [0, 1]: ``format_weight`` for answering with digits of the right
length, the rest for per-position correctness, so a random-init model gets a
dense signal (a plain exact-match reward is ~0 for it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moe_rl.rollout.tokenizer import BOS_ID, EOS_ID, task_vocab

RewardFn = Callable[["Prompt", list[int]], float]


@dataclass(frozen=True)
class Prompt:
    """One task instance: token ids fed to the engine and the expected answer ids (without eos)."""

    ids: list[int]
    answer: list[int]
    text: str
    answer_text: str


def _solve(task: str, digits: list[int]) -> list[int]:
    if task == "copy":
        return list(digits)
    if task == "reverse":
        return digits[::-1]
    if task == "sort":
        return sorted(digits)
    if task == "max":
        return [max(digits)]
    if task == "add":
        return [int(c) for c in str(digits[0] * 10 + digits[1] + digits[2] * 10 + digits[3])]
    raise ValueError(f"train.task={task!r} is not a known task; expected one of {sorted(TASKS)}")


TASKS = {"copy": 3, "reverse": 3, "sort": 4, "max": 4, "add": 4}  # task -> digits in the prompt


class DigitTask:
    """Prompts of ``num_digits`` random digits for one of ``TASKS``; reward per ``score``."""

    def __init__(self, name: str, vocab_size: int, num_digits: int | None = None, format_weight: float = 0.3):
        if name not in TASKS:
            raise ValueError(f"train.task={name!r} is not a known task; expected one of {sorted(TASKS)}")
        self.name = name
        self.num_digits = num_digits or TASKS[name]
        self.format_weight = format_weight
        self.vocab = task_vocab(vocab_size)
        self.digit_ids = [self.vocab[str(d)] for d in range(10)]
        self._digit_of = {tok: d for d, tok in enumerate(self.digit_ids)}

    def make_prompt(self, digits: list[int]) -> Prompt:
        if self.name == "add":  # "add : 3 1 + 4 2 >"
            words = [self.name, ":", str(digits[0]), str(digits[1]), "+", str(digits[2]), str(digits[3]), ">"]
        else:
            words = [self.name, ":", *map(str, digits), ">"]
        answer = _solve(self.name, digits)
        return Prompt(
            ids=[BOS_ID] + [self.vocab[w] for w in words],
            answer=[self.digit_ids[d] for d in answer],
            text=" ".join(words),
            answer_text=" ".join(map(str, answer)),
        )

    def sample_prompts(self, n: int, rng: np.random.Generator) -> list[Prompt]:
        return [self.make_prompt(rng.integers(0, 10, self.num_digits).tolist()) for _ in range(n)]

    def score(self, prompt: Prompt, response_ids: list[int]) -> float:
        """``format_weight * format + (1 - format_weight) * accuracy`` in [0, 1].

        format: fraction of the answer's positions holding a digit, times 1 if the
        response then stops (eos or end) within one extra token; accuracy: fraction
        of answer positions with the right digit.
        """
        response_ids = list(response_ids)
        body = response_ids[:-1] if response_ids[-1:] == [EOS_ID] else response_ids
        n = len(prompt.answer)
        head = body[:n]
        digits = sum(t in self._digit_of for t in head) / n
        stops = 1.0 if len(body) <= n + 1 else 0.5
        accuracy = sum(a == b for a, b in zip(head, prompt.answer, strict=False)) / n
        return self.format_weight * digits * stops + (1.0 - self.format_weight) * accuracy


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``'package.module:function'``; the function takes ``(prompt: Prompt, response_ids) -> float``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"train.reward_fn={spec!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"train.reward_fn={spec!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise ValueError(f"train.reward_fn={spec!r} is not callable")
    return fn


def build_task(train_cfg, vocab_size: int) -> tuple[DigitTask, RewardFn]:
    """The configured task and its reward function (``train.reward_fn`` overrides the task's score)."""
    task = DigitTask(train_cfg.task, vocab_size)
    return task, (load_reward_fn(train_cfg.reward_fn) if train_cfg.reward_fn else task.score)
