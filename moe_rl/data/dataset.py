"""A prompt dataset: every row of ``data.train_files`` tokenised, labelled and traced to its file and row.

Owns loading rows into ``PromptItem``s: the prompt ids (``moe_rl.data.chat``), the label
(``data.label_key``), verl's ``data_source`` (the row's field, else the file's stem) and
``extra_info`` (the row's field, else the row minus its prompt and label keys), and the
``data.max_prompt_tokens`` rule (overlong prompts dropped and counted, or an error).
"""

from __future__ import annotations

from pathlib import Path

from moe_rl.data.chat import prompt_ids
from moe_rl.data.loaders import MISSING, DataError, get_field, read_rows
from moe_rl.data.stream import PromptItem

__all__ = ["load_prompt_items", "prompt_token_limit"]


def prompt_token_limit(cfg) -> int:
    """``data.max_prompt_tokens``, or the room ``model.seq_length`` leaves after ``rollout.max_new_tokens``."""
    room = cfg.model.seq_length - cfg.rollout.max_new_tokens
    return cfg.data.max_prompt_tokens if cfg.data.max_prompt_tokens is not None else room


def _extra_info(row: dict, data_cfg):
    if "extra_info" in row:
        return row["extra_info"]
    skip = {data_cfg.prompt_key.split(".")[0], data_cfg.label_key.split(".")[0]}
    return {k: v for k, v in row.items() if k not in skip}


def load_prompt_items(files: list[str], tokenizer, cfg, log=print) -> tuple[list[PromptItem], int]:
    """``(items, dropped)``: the kept rows of ``files`` in file order, and how many were too long."""
    d, limit = cfg.data, prompt_token_limit(cfg)
    items: list[PromptItem] = []
    dropped = 0
    for file in files:
        for r, row in enumerate(read_rows(file)):
            where = f"{file} row {r}"
            prompt = get_field(row, d.prompt_key)
            label = get_field(row, d.label_key)
            for key, value in (("data.prompt_key", prompt), ("data.label_key", label)):
                if value is MISSING:
                    name = d.prompt_key if key == "data.prompt_key" else d.label_key
                    raise DataError(f"{where} has no field {key}={name!r} (its keys: {sorted(row)})")
            ids = prompt_ids(tokenizer, prompt, d, where)
            if len(ids) > limit:
                if d.overlong_prompts == "error":
                    raise DataError(f"{where}: the prompt has {len(ids)} tokens > {limit} (data.max_prompt_tokens, or "
                                    "model.seq_length - rollout.max_new_tokens); data.overlong_prompts='error'")  # fmt: skip
                dropped += 1
                continue
            source = row.get("data_source")
            items.append(PromptItem(ids=ids, label=label, data_source=str(source) if source is not None else Path(file).stem,
                                    extra_info=_extra_info(row, d), file=str(file), row=r))  # fmt: skip
    if dropped and log is not None:
        log(f"data: dropped {dropped} prompt(s) longer than {limit} tokens (data.overlong_prompts='drop')")
    if not items:
        raise DataError(f"data.train_files={list(files)}: no usable prompt ({dropped} dropped as longer than {limit} "
                        "tokens)")  # fmt: skip
    return items, dropped
