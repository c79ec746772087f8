"""A prompt dataset: the rows of ``data.train_files`` as prompts, each read, tokenised and checked when drawn.

Owns turning a row into a ``PromptItem``: the prompt ids (``moe_rl.data.chat``), the label
(``data.label_key``), verl's ``data_source`` (the row's field, else the file's stem) and
``extra_info`` (the row's field, else the row minus its prompt and label keys), the label rule (a
missing or null label is an error naming the file and row, unless the reward function declares
``needs_label = False``: then the row is scored with ``ground_truth=None``, warned about once and
counted) and the ``data.max_prompt_tokens`` rule (an overlong prompt is skipped and counted, or an
error). ``DatasetPrompts`` opens the files (``moe_rl.data.loaders.open_rows``: an index or a
memory-mapped copy, never the rows' contents in memory) and makes each prompt when the stream
draws it, so a run over a million rows starts in seconds; only rank 0 holds it (the loop hands the
other ranks the records rank 0 wrote).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moe_rl.data.chat import prompt_ids
from moe_rl.data.loaders import MISSING, DataError, get_field, open_rows
from moe_rl.data.prompt import PromptItem
from moe_rl.reward.custom import load_function

__all__ = [
    "DATA_CACHE_DIR",
    "DatasetPrompts",
    "data_cache_dir",
    "load_prompt_items",
    "prompt_token_limit",
    "reward_needs_label",
]

DATA_CACHE_DIR = "data_cache"  # <train.output_dir>/data_cache: memory-mapped Arrow copies of parquet files


def prompt_token_limit(cfg) -> int:
    """``data.max_prompt_tokens``, or the room ``model.seq_length`` leaves after ``rollout.max_new_tokens``."""
    room = cfg.model.seq_length - cfg.rollout.max_new_tokens
    return cfg.data.max_prompt_tokens if cfg.data.max_prompt_tokens is not None else room


def data_cache_dir(cfg) -> Path:
    return Path(cfg.train.output_dir) / DATA_CACHE_DIR


def reward_needs_label(cfg) -> bool:
    """Whether the reward needs each row's label: the built-in ``math`` / ``exact_match`` do; a custom
    function does unless it carries the attribute ``needs_label = False`` (a verl reward file without it
    is unchanged: it gets a label for every row)."""
    if cfg.reward.type != "custom" or not cfg.reward.function:
        return True

    return getattr(load_function(cfg.reward.function), "needs_label", True) is not False


def _extra_info(row: dict, data_cfg):
    if "extra_info" in row:
        return row["extra_info"]
    skip = {data_cfg.prompt_key.split(".")[0], data_cfg.label_key.split(".")[0]}
    return {k: v for k, v in row.items() if k not in skip}


class DatasetPrompts:
    """The rows of ``files`` as one index ``0 .. len-1`` (file order); ``get(i)`` is the prompt of row ``i``,
    or None for a prompt longer than ``prompt_token_limit`` (``data.overlong_prompts='drop'``)."""

    def __init__(self, files: list[str], tokenizer, cfg, needs_label: bool = True, log=print):
        self.cfg, self.tokenizer, self.needs_label, self.log = cfg, tokenizer, needs_label, log
        self.limit = prompt_token_limit(cfg)
        self.files = [open_rows(f, data_cache_dir(cfg)) for f in files]
        self.names = [str(f) for f in files]
        self.ends = np.cumsum([len(rows) for rows in self.files], dtype=np.int64)
        self.dropped = self.unlabelled = 0
        if not len(self):
            raise DataError(f"data files {self.names} hold no rows; expected at least one prompt")

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _locate(self, i: int) -> tuple[int, int]:
        f = int(np.searchsorted(self.ends, i, side="right"))
        return f, i - (int(self.ends[f - 1]) if f else 0)

    def _note_first(self, count: int, message: str) -> None:
        """Log ``message`` for the first of its kind only (later ones are counted)."""
        if not count and self.log is not None:
            self.log(message)

    def _label(self, row: dict, where: str):
        key = self.cfg.data.label_key
        label = get_field(row, key)
        if label is not MISSING and label is not None:
            return label
        what = (
            f"has no field data.label_key={key!r} (its keys: {sorted(row)})"
            if label is MISSING
            else f"has a null data.label_key={key!r}"
        )
        if self.needs_label:
            raise DataError(
                f"{where} {what}; expected a label for every row (the reward compares the response with "
                "it; a custom reward function that needs none declares `needs_label = False`)"
            )
        self._note_first(
            self.unlabelled,
            f"data: {where} {what}: scored with ground_truth=None (the reward function "
            "declares needs_label=False); such samples are counted in reward/no_label",
        )
        self.unlabelled += 1
        return None

    def get(self, i: int) -> PromptItem | None:
        d = self.cfg.data
        f, r = self._locate(int(i))
        rows, file = self.files[f], self.names[f]
        row = rows[r]
        where = f"{file} row {r}"
        prompt = get_field(row, d.prompt_key)
        if prompt is MISSING:
            raise DataError(f"{where} has no field data.prompt_key={d.prompt_key!r} (its keys: {sorted(row)})")
        label = self._label(row, where)
        ids = prompt_ids(self.tokenizer, prompt, d, where)
        if len(ids) > self.limit:
            if d.overlong_prompts == "error":
                raise DataError(
                    f"{where}: the prompt has {len(ids)} tokens > {self.limit} (data.max_prompt_tokens, or "
                    "model.seq_length - rollout.max_new_tokens); data.overlong_prompts='error'"
                )
            self._note_first(
                self.dropped,
                f"data: {where}: the prompt has {len(ids)} tokens > {self.limit}: skipped "
                "(data.overlong_prompts='drop'; each epoch's count is logged at its end)",
            )
            self.dropped += 1
            return None
        source = row.get("data_source")
        return PromptItem(
            ids=ids,
            label=label,
            data_source=str(source) if source is not None else Path(file).stem,
            extra_info=_extra_info(row, d),
            file=file,
            row=r,
        )

    def no_prompt_error(self) -> DataError:
        return DataError(
            f"data.train_files={self.names}: no usable prompt (all {len(self)} rows are longer than "
            f"{self.limit} tokens)"
        )


def load_prompt_items(
    files: list[str], tokenizer, cfg, log=print, limit: int | None = None, needs_label: bool = True
) -> tuple[list[PromptItem], int]:
    """``(items, dropped)``: the kept rows of ``files`` in file order (the first ``limit`` of them), and how
    many were too long (eval sets and tests; training draws from a ``DatasetPrompts`` on demand)."""
    data = DatasetPrompts(files, tokenizer, cfg, needs_label=needs_label, log=None)
    items: list[PromptItem] = []
    for i in range(len(data)):
        if limit is not None and len(items) >= limit:
            break
        item = data.get(i)
        if item is not None:
            items.append(item)
    if data.dropped and log is not None:
        log(f"data: dropped {data.dropped} prompt(s) longer than {data.limit} tokens (data.overlong_prompts='drop')")
    if not items:
        raise DataError(
            f"data.train_files={list(files)}: no usable prompt ({data.dropped} dropped as longer than "
            f"{data.limit} tokens)"
        )
    return items, data.dropped
