"""YAML loading for experiment configs: ``extends:`` chains, dotted overrides, one clear error.

Owns turning files + ``a.b.c=value`` strings into a validated ``ExperimentConfig``
and back into YAML. Every failure raises ``ConfigError`` naming the dotted key.
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import yaml
from pydantic import ValidationError

from moe_rl.config.schema import ExperimentConfig


class ConfigError(ValueError):
    """An experiment config that cannot be used; the message names the dotted key."""


def deep_merge(base: dict, override: dict) -> dict:
    """Recursively merge ``override`` into a copy of ``base`` (dicts merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _duplicate_keys(node: yaml.Node, prefix: str = "") -> list[str]:
    """``'a.b' (lines 3 and 5)`` for each key repeated within one mapping of a composed YAML tree."""
    found: list[str] = []
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            dotted = f"{prefix}{key}"
            if key in first_line:
                found.append(f"{dotted!r} (lines {first_line[key]} and {key_node.start_mark.line + 1})")
            else:
                first_line[key] = key_node.start_mark.line + 1
            found += _duplicate_keys(value_node, dotted + ".")
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicate_keys(item, f"{prefix[:-1]}[{i}]." if prefix else f"[{i}].")
    return found


def _read_yaml(path: Path) -> dict:
    if path.is_dir():
        raise ConfigError(f"config path {path} is a directory; expected a YAML file")
    try:
        text = path.read_text(encoding="utf-8")
        duplicates = _duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
        data = yaml.safe_load(text)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config path {path} is not a UTF-8 text file; expected a YAML file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"malformed YAML in {path}: {exc}") from None
    if duplicates:
        raise ConfigError(f"{path}: duplicate key " + ", ".join(duplicates) + "; each key may appear once per section")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_yaml_tree(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Read ``path`` and resolve its ``extends:`` (a path or list of paths, relative to the file)."""
    path = Path(path).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"extends: cycle in config files: {chain}")
    data = _read_yaml(path)
    parents = data.pop("extends", None) or []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: extends must be a path or a list of paths, got {parents!r}")
    merged: dict = {}
    for parent in parents:
        merged = deep_merge(merged, load_yaml_tree(path.parent / parent, (*_seen, path)))
    return deep_merge(merged, data)


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings; values are parsed as YAML scalars/lists (``x=[1,2]``, ``y=null``)."""
    tree = copy.deepcopy(tree)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from None
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return tree


def _describe_error(err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"unknown key {loc!r}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{loc}={err.get('input')!r} is not allowed; expected one of {expected}"
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "value_error":  # our cross-field checks already name their dotted keys
        return msg
    return f"{loc}: {msg} (got {err.get('input')!r})" if loc else msg


def validate_tree(tree: dict) -> ExperimentConfig:
    """Validate a plain dict as an ExperimentConfig, raising one ConfigError listing every problem."""
    try:
        return ExperimentConfig.model_validate(tree)
    except ValidationError as exc:
        problems = sorted({_describe_error(e) for e in exc.errors()})
        raise ConfigError("invalid experiment config:\n  " + "\n  ".join(problems)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load YAML (with extends) or defaults, apply dotted overrides, validate."""
    tree = load_yaml_tree(path) if path is not None else {}
    return validate_tree(apply_overrides(tree, list(overrides or [])))


def dump_config(cfg: ExperimentConfig) -> str:
    """YAML text that ``load_config`` turns back into an equal config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def save_config(cfg: ExperimentConfig, path: str | Path) -> Path:
    """Write ``dump_config(cfg)`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(dump_config(cfg))
    os.replace(tmp, path)
    return path
