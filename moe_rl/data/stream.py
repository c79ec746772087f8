"""The resumable prompt stream: what the training loop asks for the next prompts of a step.

Owns the one interface the loop sees (``next_prompts(step, n, round)``, ``state()``, ``load_state()``) and
its two implementations:

* ``TaskStream`` -- the built-in digit tasks (``train.task``): prompts drawn from
  ``np.random.default_rng([train.seed, step])`` exactly as before, so the random streams (and the
  committed records and demo metrics) do not move; it has no position to save.
* ``DatasetStream`` -- ``data.train_files``: rows in a seeded order, reshuffled every epoch
  (``default_rng([seed, epoch, DATA_SALT])``), a batch spilling into the next epoch when one ends; its
  position ``(epoch, index)`` goes into every checkpoint, so a resumed run continues with exactly the
  prompts an uninterrupted run would have used. The order is over the files' rows; a row the dataset
  skips (an overlong prompt) is passed over where it falls.
"""

from __future__ import annotations

import numpy as np

from moe_rl.data.dataset import DatasetPrompts, reward_needs_label
from moe_rl.data.loaders import DataError
from moe_rl.data.prompt import PromptItem, PromptStream

__all__ = ["DATA_SALT", "DatasetStream", "PromptItem", "PromptStream", "TaskStream", "build_prompt_stream"]

DATA_SALT = 0xDA7A  # keeps the shuffle's random stream apart from the per-step sampling streams


class TaskStream:
    """The built-in digit task as a prompt stream (stateless: step ``s`` always draws the same prompts)."""

    def __init__(self, task, seed: int):
        self.task, self.seed = task, seed

    def next_prompts(self, step: int, n: int, round: int = 0) -> list[PromptItem]:
        """Round 0 draws from ``default_rng([seed, step])``; later rounds of a step (dynamic sampling)
        from ``default_rng([seed, step, round])``."""
        rng = np.random.default_rng([self.seed, step] if round == 0 else [self.seed, step, round])
        return [
            PromptItem(ids=p.ids, label=p.answer_text, data_source=self.task.name, task_prompt=p)
            for p in self.task.sample_prompts(n, rng)
        ]

    def state(self) -> None:
        return None

    def load_state(self, state: dict | None) -> None:
        return None


class DatasetStream:
    """Rows of a prompt dataset in a seeded order per epoch; position ``(epoch, index)``.

    ``items`` is a list of ``PromptItem``s or a ``moe_rl.data.dataset.DatasetPrompts`` (rows made into
    prompts when drawn; ``get(i)`` is None for a row that is skipped, which the stream passes over)."""

    def __init__(self, items, seed: int, shuffle: bool = True, log=print):
        if not len(items):
            raise ValueError("a DatasetStream needs at least one prompt")
        self.items, self.seed, self.shuffle, self.log = items, seed, shuffle, log
        self._get = getattr(items, "get", None) or items.__getitem__
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, np.arange(0)
        self._skipped_run = 0  # rows skipped in a row (a whole epoch of them: no usable prompt)

    def order(self, epoch: int) -> np.ndarray:
        """Row order of ``epoch`` (a permutation of the items, or file order without shuffle)."""
        if self._order_epoch != epoch:
            n = len(self.items)
            self._order = (
                np.random.default_rng([self.seed, epoch, DATA_SALT]).permutation(n) if self.shuffle else np.arange(n)
            )
            self._order_epoch = epoch
        return self._order

    def next_prompts(self, step: int, n: int, round: int = 0) -> list[PromptItem]:
        """The next ``n`` usable rows (every call moves the position, so a later round gets new rows)."""
        out: list[PromptItem] = []
        while len(out) < n:
            item = self._get(int(self.order(self.epoch)[self.index]))
            self.index += 1
            if self.index == len(self.items):  # an epoch ends: the position moves to the next one
                self._epoch_done()
            if item is not None:
                out.append(item)
                self._skipped_run = 0
                continue
            self._skipped_run += 1
            if self._skipped_run >= len(self.items):
                raise self.items.no_prompt_error()
        return out

    def _epoch_done(self) -> None:
        dropped = getattr(self.items, "dropped", 0)
        if dropped and self.log is not None:
            self.log(
                f"data: epoch {self.epoch} done; {dropped} prompt(s) longer than {self.items.limit} tokens "
                "skipped so far (data.overlong_prompts='drop')"
            )
        self.epoch, self.index = self.epoch + 1, 0

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "size": len(self.items)}

    def load_state(self, state: dict | None) -> None:
        if not state:
            return
        if int(state.get("size", len(self.items))) != len(self.items):
            raise DataError(
                f"the checkpoint's dataset position is for {state['size']} prompts; data.train_files now "
                f"yield {len(self.items)} (files changed)"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def build_prompt_stream(cfg, tokenizer=None, log=print) -> PromptStream:
    """The stream for ``cfg``: ``data.train_files`` when a ``data`` section is set, else ``train.task``."""
    if cfg.data is None:
        from moe_rl.tasks.synthetic import DigitTask  # noqa: PLC0415  the task tokenizer imports transformers

        return TaskStream(DigitTask(cfg.train.task, cfg.model.vocab_size), cfg.train.seed)

    items = DatasetPrompts(cfg.data.train_files, tokenizer, cfg, needs_label=reward_needs_label(cfg), log=log)
    return DatasetStream(items, cfg.train.seed, cfg.data.shuffle, log=log)
