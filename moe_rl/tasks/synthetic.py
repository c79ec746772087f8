"""Synthetic tasks with verifiable rewards that a tiny model can learn on CPU, and user reward hooks.

Owns prompt generation (copy / reverse / sort / add / max over short digit strings)
and scoring. A prompt reads ``<bos> reverse : 3 1 4 >`` and the answer ``4 1 3 <eos>``.
Rewards are in [0, 1]: ``format_weight`` for answering with digits of the right
length, the rest for per-position correctness, so a random-init model gets a
dense signal (a plain exact-match reward is ~0 for it).

The ``*_long`` variants (``copy_long``, ``reverse_long``, ``sort_long``) draw 7-11 digits per
prompt, so responses are 8-12 tokens and vary in length, and they must end with ``<eos>``
right after the answer to earn the full format credit (the warm-started demo uses ``copy_long``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moe_rl.tasks.tokenizer import BOS_ID, EOS_ID, task_vocab

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
    raise ValueError(f"train.task={task!r} is not a known task; expected one of {KNOWN_TASKS}")


TASKS = {"copy": 3, "reverse": 3, "sort": 4, "max": 4, "add": 4}  # task -> digits in the prompt
# EOS-terminated variants with a varying number of digits: name -> (base task, min digits, max digits)
LONG_TASKS = {f"{base}_long": (base, 7, 11) for base in ("copy", "reverse", "sort")}
KNOWN_TASKS = sorted([*TASKS, *LONG_TASKS])


class DigitTask:
    """Prompts of ``num_digits`` random digits for one of ``TASKS``; reward per ``score``."""

    def __init__(self, name: str, vocab_size: int, num_digits: int | None = None, format_weight: float = 0.3):
        if name not in TASKS and name not in LONG_TASKS:
            raise ValueError(f"train.task={name!r} is not a known task; expected one of {KNOWN_TASKS}")
        base, low, high = LONG_TASKS.get(name, (name, TASKS.get(name), TASKS.get(name)))
        self.name = name
        self.base = base  # the operation and the prompt's task word
        self.requires_eos = name in LONG_TASKS
        self.digit_range = (num_digits, num_digits) if num_digits else (low, high)
        self.format_weight = format_weight
        self.vocab = task_vocab(vocab_size)
        self.digit_ids = [self.vocab[str(d)] for d in range(10)]
        self._digit_of = {tok: d for d, tok in enumerate(self.digit_ids)}

    def make_prompt(self, digits: list[int]) -> Prompt:
        if self.base == "add":  # "add : 3 1 + 4 2 >"
            words = [self.base, ":", str(digits[0]), str(digits[1]), "+", str(digits[2]), str(digits[3]), ">"]
        else:
            words = [self.base, ":", *map(str, digits), ">"]
        answer = _solve(self.base, digits)
        return Prompt(
            ids=[BOS_ID] + [self.vocab[w] for w in words],
            answer=[self.digit_ids[d] for d in answer],
            text=" ".join(words),
            answer_text=" ".join(map(str, answer)),
        )

    def sample_prompts(self, n: int, rng: np.random.Generator) -> list[Prompt]:
        low, high = self.digit_range
        if low == high:  # the fixed-length tasks keep their original random stream
            return [self.make_prompt(rng.integers(0, 10, low).tolist()) for _ in range(n)]
        return [self.make_prompt(rng.integers(0, 10, int(rng.integers(low, high + 1))).tolist()) for _ in range(n)]

    def score(self, prompt: Prompt, response_ids: list[int]) -> float:
        """``format_weight * format + (1 - format_weight) * accuracy`` in [0, 1].

        format: fraction of the answer's positions holding a digit, times 1 if the
        response then stops (eos or end) within one extra token -- for the ``*_long``
        tasks only if ``<eos>`` follows the answer's last position exactly -- else 0.5;
        accuracy: fraction of answer positions with the right digit.
        """
        response_ids = list(response_ids)
        ends_with_eos = response_ids[-1:] == [EOS_ID]
        body = response_ids[:-1] if ends_with_eos else response_ids
        n = len(prompt.answer)
        head = body[:n]
        digits = sum(t in self._digit_of for t in head) / n
        if self.requires_eos:
            stops = 1.0 if ends_with_eos and len(body) == n else 0.5
        else:
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
        raise ValueError(f"train.reward_fn={spec!r} is not callable")  # noqa: TRY004 -- a config error
    return fn


def build_task(train_cfg, vocab_size: int) -> tuple[DigitTask, RewardFn]:
    """The configured task and its reward function (``train.reward_fn`` overrides the task's score)."""
    task = DigitTask(train_cfg.task, vocab_size)
    return task, (load_reward_fn(train_cfg.reward_fn) if train_cfg.reward_fn else task.score)
