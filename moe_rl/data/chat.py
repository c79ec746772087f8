"""Tokenizers and chat templates: the model's own tokenizer and how a dataset prompt becomes ids.

Owns loading the tokenizer (``AutoTokenizer.from_pretrained(model.hf_path, local_files_only=True)``,
or the built-in task tokenizer without ``hf_path``; a directory without a usable tokenizer is refused),
the stop tokens and turning a prompt field into token ids: a string is one user message, a list is chat
messages ``[{role, content}]``, and ``data.system_prompt`` is prepended as a system message unless the
row has its own system turn. With ``data.apply_chat_template`` the ids are exactly
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
**data.chat_template_kwargs)`` -- never decoded and re-encoded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from moe_rl.data.loaders import DataError

__all__ = ["has_chat_template", "load_tokenizer", "prompt_ids", "stop_token_ids", "to_messages", "tokenizer_problem"]

PROBE_TEXT = "What is 2 + 3?"


def tokenizer_problem(tokenizer, hf_path: str) -> str | None:
    """Why ``model.hf_path``'s tokenizer cannot tokenise prompts (None: it can). Without tokenizer files
    ``AutoTokenizer`` still returns a tokenizer -- one of ~1 token that encodes every text to ``[]``."""
    ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    if len(tokenizer) > 1 and ids:
        return None
    return (
        f"model.hf_path={hf_path!r} has no usable tokenizer: AutoTokenizer loaded a {type(tokenizer).__name__} "
        f"of {len(tokenizer)} token(s) that encodes {PROBE_TEXT!r} as {ids}; expected the model's tokenizer files "
        "there (tokenizer.json, or vocab.json + merges.txt / tokenizer.model, with tokenizer_config.json)"
    )


def load_tokenizer(cfg):
    """The experiment's tokenizer: ``model.hf_path``'s (local files only), else the task tokenizer."""
    if cfg.model.hf_path:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path, local_files_only=True)
        if (problem := tokenizer_problem(tokenizer, cfg.model.hf_path)) is not None:
            raise DataError(problem)
        return tokenizer
    from moe_rl.tasks.tokenizer import build_task_tokenizer  # noqa: PLC0415  the task tokenizer imports transformers

    return build_task_tokenizer(cfg.model.vocab_size)


def stop_token_ids(tokenizer, hf_path: str | None = None) -> list[int]:
    """Ids that end a response: the tokenizer's EOS and ``generation_config.json``'s ``eos_token_id``."""

    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    gen = Path(hf_path or "") / "generation_config.json"
    if hf_path and gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def to_messages(prompt: Any, system_prompt: str | None, where: str) -> list[dict]:
    """A prompt field as chat messages (``where`` names file and row in errors)."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    ):
        messages = [dict(m) for m in prompt]
    else:
        raise DataError(
            f"{where}: the prompt must be a string or a non-empty list of {{role, content}} messages, "
            f"got {type(prompt).__name__}"
        )
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):  # the row's own wins
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def prompt_ids(tokenizer, prompt: Any, data_cfg, where: str) -> list[int]:
    """Token ids of one prompt field per ``data.apply_chat_template`` / ``system_prompt`` / ``chat_template_kwargs``."""
    if data_cfg.apply_chat_template:
        messages = to_messages(prompt, data_cfg.system_prompt, where)
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **data_cfg.chat_template_kwargs
        )
        return [int(t) for t in ids]
    if not isinstance(prompt, str):
        raise DataError(
            f"{where}: a {type(prompt).__name__} prompt needs data.apply_chat_template=true "
            "(only a string prompt is encoded as plain text)"
        )
    return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=True)]
