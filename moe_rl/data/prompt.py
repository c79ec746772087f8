"""What a prompt stream hands a step: ``PromptItem`` (ids, reward inputs, provenance) and the ``PromptStream``
protocol every stream (built-in task, dataset file) implements. A leaf: the streams and the dataset import it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a step: its token ids and what the reward needs, traced to its dataset file and row."""

    ids: list[int]
    label: Any = None
    data_source: str = ""
    extra_info: Any = None
    file: str = ""  # "" for the built-in tasks
    row: int = -1
    task_prompt: Any = None  # the built-in task's Prompt (moe_rl.tasks.synthetic)


class PromptStream(Protocol):
    def next_prompts(self, step: int, n: int, round: int = 0) -> list[PromptItem]: ...

    def state(self) -> dict | None: ...

    def load_state(self, state: dict | None) -> None: ...
