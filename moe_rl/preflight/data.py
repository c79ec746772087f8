"""Preflight config rules for ``model.hf_path``, the ``data`` section and the ``reward`` section.

Owns what would otherwise fail at the first step of a run on a user's own model and data: a model
directory that is missing or unreadable, a ``model`` key that contradicts its ``config.json``, a
tokenizer without the chat template the config asks for, dataset files that are missing or lack the
configured keys in their first row, and reward settings that cannot score the prompts. Each rule
yields messages that name the dotted key, its value and what would work (docs/data.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from moe_rl.config.hf_model import HFModelError, model_keys_from_hf, read_hf_config, same_value
from moe_rl.data.chat import tokenizer_problem
from moe_rl.data.dataset import reward_needs_label
from moe_rl.data.loaders import MISSING, DataError, first_row, get_field
from moe_rl.reward.custom import load_function

__all__ = ["data_files", "hf_model_directory", "reward_settings", "unbuilt_model"]


def _contradictions(cfg, derived: dict) -> Iterable[str]:
    m, where = cfg.model, f"{cfg.model.hf_path}/config.json"
    for key, value in derived.items():
        if key == "moe_layer_freq":
            want = value if isinstance(value, list) else [1] * m.num_layers
            if m.moe_layer_pattern() != want and not m.first_k_dense_layers:
                yield (
                    f"model.moe_layer_freq={m.moe_layer_freq!r} contradicts {where}, which gives {value!r}; drop "
                    f"model.moe_layer_freq (it is read from config.json) or set it to {value!r}"
                )
            continue
        mine = getattr(m, key)
        if not same_value(key, mine, value):
            yield (
                f"model.{key}={mine!r} contradicts {where}, which gives {value!r}; drop model.{key} (it is read "
                f"from config.json) or set it to {value!r}"
            )


def _tokenizer(hf_path: str):
    from transformers import AutoTokenizer  # noqa: PLC0415  heavy import, only for a config with model.hf_path

    return AutoTokenizer.from_pretrained(hf_path, local_files_only=True)


def unbuilt_model(cfg) -> str | None:
    """The problem of a ``model.hf_path`` that does not exist yet but that ``model.build_command`` creates
    (``config validate`` reports it as a note and checks the rest; ``train`` refuses it)."""
    path, command = cfg.model.hf_path, cfg.model.build_command
    if not path or not command or Path(path).expanduser().exists():
        return None
    return (
        f"model.hf_path={path!r} is not built yet: run `{command}` (model.build_command) to create it; "
        "the architecture, weights and tokenizer are read from it"
    )


def hf_model_directory(cfg) -> Iterable[str]:
    """``model.hf_path`` is a readable Qwen3-MoE / GLM-4.5 directory that agrees with the ``model`` keys."""
    path = cfg.model.hf_path
    if not path:
        if cfg.data is not None:
            yield (
                "data.train_files needs model.hf_path: dataset prompts are tokenised with the model's own "
                "tokenizer (the built-in task tokenizer only knows digits)"
            )
        return
    if (unbuilt := unbuilt_model(cfg)) is not None:
        yield unbuilt
        return
    try:
        hf = read_hf_config(path)
        derived = model_keys_from_hf(hf, path)
    except HFModelError as exc:
        yield str(exc)
        return
    yield from _contradictions(cfg, derived)
    if hf.get("tie_word_embeddings"):
        yield (
            f"model.hf_path={path!r}: config.json has tie_word_embeddings=true; the learner trains a separate "
            "output layer (lm_head), expected an untied model"
        )
    if not cfg.checkpoint.init_from_hf and not any(Path(path).expanduser().glob("*.safetensors")):
        yield f"model.hf_path={path!r} holds no *.safetensors weights; expected the model's weights (or set checkpoint.init_from_hf)"
    try:
        tokenizer = _tokenizer(path)
    except Exception as exc:  # noqa: BLE001 -- any loader failure: one message naming the key
        yield f"model.hf_path={path!r}: its tokenizer cannot be loaded with local files only ({type(exc).__name__}: {exc})"
        return
    if (problem := tokenizer_problem(tokenizer, path)) is not None:
        yield problem
        return
    if cfg.data is not None and cfg.data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        yield (
            f"data.apply_chat_template=true but the tokenizer of model.hf_path={path!r} has no chat template; set "
            "data.apply_chat_template=false or add one (chat_template.jinja, or 'chat_template' in tokenizer_config.json)"
        )


def _first_row_problems(key: str, files: list[str], d, needs_label: bool) -> Iterable[str]:
    for i, file in enumerate(files):
        if not Path(file).expanduser().is_file():
            yield f"{key}[{i}]={file!r} does not exist; expected a local .jsonl, .json or .parquet file"
            continue
        try:
            row = first_row(file)
        except DataError as exc:
            yield f"{key}[{i}]={file!r}: {exc}"
            continue
        for name, field in (("data.prompt_key", d.prompt_key), ("data.label_key", d.label_key)):
            value = get_field(row, field)
            if value is MISSING:
                yield f"{name}={field!r} is not a field of the first row of {file} (its keys: {sorted(row)})"
            elif value is None and (name == "data.prompt_key" or needs_label):
                yield (
                    f"{name}={field!r} is null in the first row of {file}; expected a value in every row (a "
                    "custom reward function that needs no label declares `needs_label = False`)"
                )


def _needs_label(cfg) -> bool:
    try:
        return reward_needs_label(cfg)
    except ValueError:  # reward.function cannot be loaded: reward_settings says why
        return True


def data_files(cfg) -> Iterable[str]:
    """Files exist and their first row holds the keys; lengths and settings fit together."""
    d = cfg.data
    if d is None:
        return
    needs_label = _needs_label(cfg)
    yield from _first_row_problems("data.train_files", d.train_files, d, needs_label)
    yield from _first_row_problems("data.eval_files", d.eval_files, d, needs_label)
    if d.system_prompt is not None and not d.apply_chat_template:
        yield "data.system_prompt needs data.apply_chat_template=true (it is sent as a system message)"
    m, r = cfg.model, cfg.rollout
    if d.max_prompt_tokens is not None and d.max_prompt_tokens + r.max_new_tokens > m.seq_length:
        yield (
            f"data.max_prompt_tokens={d.max_prompt_tokens} plus rollout.max_new_tokens={r.max_new_tokens} exceeds "
            f"model.seq_length={m.seq_length}; expected data.max_prompt_tokens <= {m.seq_length - r.max_new_tokens}"
        )
    elif m.seq_length - r.max_new_tokens < 1:
        yield f"rollout.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in model.seq_length={m.seq_length}"
    if cfg.train.warm_start is not None:
        yield (
            "train.warm_start is a supervised phase on the built-in digit task; with data.train_files expected "
            "train.warm_start=null"
        )


def reward_settings(cfg) -> Iterable[str]:
    """The reward type fits the prompts, and a custom function imports with verl's signature."""
    rw = cfg.reward
    if cfg.data is not None and rw.type == "task":
        yield (
            "reward.type='task' scores the built-in digit tasks (train.task); with data.train_files expected "
            "'math', 'exact_match' or 'custom'"
        )
    if cfg.data is None and rw.type != "task":
        yield (
            f"reward.type={rw.type!r} scores dataset labels; set data.train_files (the built-in task train.task="
            f"{cfg.train.task!r} is scored by reward.type='task')"
        )
    if rw.type == "custom" and not rw.function:
        yield "reward.type='custom' needs reward.function ('pkg.module:fn' or 'path/to/file.py:fn')"
    if rw.function and rw.type != "custom":
        yield f"reward.function={rw.function!r} is only called with reward.type='custom' (got {rw.type!r})"
    if cfg.train.reward_fn and rw.type != "task":
        yield (
            f"train.reward_fn={cfg.train.reward_fn!r} overrides the built-in task's score; with reward.type="
            f"{rw.type!r} use reward.function"
        )
    if rw.type == "custom" and rw.function:
        try:
            load_function(rw.function)
        except ValueError as exc:
            yield str(exc)
