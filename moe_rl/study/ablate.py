"""Ablation grids: expand a YAML ``grid:`` into validated per-cell configs, train each, write the report.

Owns the grid syntax (an optional top-level ``grid:`` mapping of dotted config keys to value lists,
read and removed before schema validation), cell naming, skipping invalid combinations with a note,
and running cells one after another with the same seeds. Training is ``moe_rl.train.loop.train``;
the report is ``moe_rl.study.report.write_report``.

Default grid (seed 001, Zheng et al.: routing replay vs off-policiness N = minibatches per step)::

    grid:
      replay.routing: [none, r2, r3]
      train.minibatches_per_step: [1, 2, 4]
      seeds: [1, 2, 3]        # optional: every cell once per seed (sets train.seed and rollout.seed)

With ``seeds`` each cell runs once per seed in ``<out>/<cell>/seed-<s>/`` and the report gives
mean ± std over the seeds and curves with bands; every run starts from the same warm start
(``train.warm_start`` does not depend on the seed).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import re
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from moe_rl.config import (
    ConfigError,
    ExperimentConfig,
    TrainConfig,
    apply_overrides,
    load_yaml_tree,
    save_config,
    validate_tree,
)
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.rollout.auth import RUN_ADMIN_KEY_ENV
from moe_rl.rollout.server_pool import rollout_server_pool
from moe_rl.sizing import startup_timeout
from moe_rl.study.report import write_report
from moe_rl.train.loop import train  # heavy (torch, Megatron): only when actually running

DEFAULT_GRID: dict[str, list[Any]] = {
    "replay.routing": ["none", "r2", "r3"],
    "train.minibatches_per_step": [1, 2, 4],
}


class AblationError(RuntimeError):
    """One or more grid cells failed to train; the report was still written."""


SEED_KEYS = ("train.seed", "rollout.seed")  # what a grid-level ``seeds`` value sets


@dataclass(frozen=True)
class Cell:
    """One run of a grid point: settings, seed (None without ``seeds``), run dir, config (None when skipped)."""

    name: str
    settings: dict[str, Any]
    run_dir: Path
    config: ExperimentConfig | None
    skip_reason: str | None = None
    seed: int | None = None


def _flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    """``{replay: {routing: [..]}, 'train.steps': [..]}`` -> ``{'replay.routing': [..], 'train.steps': [..]}``."""
    flat: dict[str, Any] = {}
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        items = _flatten(value, dotted + ".").items() if isinstance(value, dict) else [(dotted, value)]
        for k, v in items:
            if k in flat:
                raise ConfigError(f"grid key {k!r} is given twice (nested and dotted)")
            flat[k] = v
    return flat


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The section class of a field annotation (``FP8Config`` for ``FP8Config | None``), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _check_grid_key(key: str) -> None:
    """``key`` must name a leaf field of ExperimentConfig, e.g. ``loss.type``."""
    model: type[BaseModel] = ExperimentConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            raise ConfigError(f"grid key {key!r}: {'.'.join(parts[: i + 1])!r} is not a config field")
        section = _section_model(field.annotation)
        if i < len(parts) - 1:
            if section is None:
                raise ConfigError(f"grid key {key!r}: {'.'.join(parts[: i + 1])!r} is not a section")
            model = section
        elif section is not None:
            raise ConfigError(f"grid key {key!r} is a whole section; vary one of its fields instead")


def parse_seeds(raw: Any) -> list[int] | None:
    """Validate ``grid.seeds`` (None: no seed axis) into a list of distinct non-negative ints."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw or not all(isinstance(s, int) and not isinstance(s, bool) for s in raw):
        raise ConfigError(f"grid.seeds must be a non-empty list of integers, got {raw!r}")
    if any(s < 0 for s in raw) or len(set(raw)) != len(raw):
        raise ConfigError(f"grid.seeds must be distinct integers >= 0, got {raw!r}")
    return list(raw)


def split_seeds(raw: Any) -> tuple[Any, list[int] | None]:
    """``grid:`` value -> (the grid without ``seeds`` (None when only seeds were given), the seeds)."""
    if not isinstance(raw, dict) or "seeds" not in raw:
        return raw, None
    rest = {k: v for k, v in raw.items() if k != "seeds"}
    return (rest or None), parse_seeds(raw["seeds"])


def parse_grid(raw: Any) -> dict[str, list[Any]]:
    """Validate a ``grid:`` value (None -> ``DEFAULT_GRID``) into dotted key -> non-empty value list."""
    if raw is None:
        return copy.deepcopy(DEFAULT_GRID)
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"grid must be a non-empty mapping of config keys to value lists, got {raw!r}")
    grid = _flatten(raw)
    for key, values in grid.items():
        _check_grid_key(key)
        if not isinstance(values, list) or not values:
            raise ConfigError(f"grid.{key} must be a non-empty list of values, got {values!r}")
        if len({repr(v) for v in values}) != len(values):
            raise ConfigError(f"grid.{key} lists a value twice: {values!r}")
    return grid


def _set(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = copy.deepcopy(value)


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return re.sub(r"[^A-Za-z0-9.]+", "_", "null" if value is None else str(value)).strip("_") or "_"


def cell_name(settings: dict[str, Any], grid_keys: list[str]) -> str:
    """Directory-safe name: ``routing-r3__minibatches_per_step-2`` (full dotted key if leaf names clash)."""
    leaves = [k.rsplit(".", 1)[-1] for k in grid_keys]
    short = {k: (leaf if leaves.count(leaf) == 1 else k.replace(".", "_")) for k, leaf in zip(grid_keys, leaves)}
    return "__".join(f"{short[k]}-{_value_text(settings[k])}" for k in grid_keys)


def expand_grid(
    config_path: str | Path, overrides: list[str] | None = None, out_dir: str | Path | None = None
) -> tuple[list[Cell], Path]:
    """All cells of the config's grid (overrides apply to the base and may set ``grid.*``) and the out dir.

    Each cell's ``train.output_dir`` is ``<out_dir>/<cell name>`` (``/seed-<s>`` per seed with
    ``grid.seeds``; ``checkpoint.dir`` likewise when set); without ``grid.seeds`` seeds are left as
    configured, so every cell starts from the same seeds. A combination the schema rejects becomes a
    cell with ``skip_reason`` set instead of an error.
    """
    tree = apply_overrides(load_yaml_tree(config_path), list(overrides or []))
    raw_grid, seeds = split_seeds(tree.pop("grid", None))
    grid = parse_grid(raw_grid)
    if seeds is not None and (clash := [k for k in SEED_KEYS if k in grid]):
        raise ConfigError(f"grid.seeds sets {' and '.join(SEED_KEYS)}; drop grid key(s) {clash} or grid.seeds")
    if out_dir is None:
        base_out = tree.get("train", {}).get("output_dir", TrainConfig.model_fields["output_dir"].default)
        out_dir = Path(base_out) / "ablation"
    out_dir = Path(out_dir)
    keys = list(grid)
    cells = []
    for combo, seed in itertools.product(itertools.product(*(grid[k] for k in keys)), seeds or [None]):
        settings = dict(zip(keys, combo))
        name = cell_name(settings, keys)
        run_dir = out_dir / name if seed is None else out_dir / name / f"seed-{seed}"
        cell_tree = copy.deepcopy(tree)
        for key, value in [*settings.items(), *((k, seed) for k in SEED_KEYS if seed is not None)]:
            _set(cell_tree, key, value)
        _set(cell_tree, "train.output_dir", str(run_dir))
        if cell_tree.get("checkpoint", {}).get("dir") is not None:
            _set(cell_tree, "checkpoint.dir", str(run_dir / "checkpoints"))
        try:
            cells.append(Cell(name, settings, run_dir, validate_tree(cell_tree), seed=seed))
        except ConfigError as exc:
            reason = str(exc).removeprefix("invalid experiment config:").strip().replace("\n", " ")
            cells.append(Cell(name, settings, run_dir, None, reason, seed=seed))
    if len({(c.name, c.seed) for c in cells}) != len(cells):
        raise ConfigError(f"grid values give two cells the same directory name: {[c.name for c in cells]}")
    return cells, out_dir


def _run_label(cell: Cell) -> str:
    return cell.name if cell.seed is None else f"{cell.name} (seed {cell.seed})"


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` inside the block (restored after)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _shared_rollout_servers(cells: list[Cell], out_dir: Path) -> Iterator[dict | None]:
    """One local SGLang server for the whole grid when every cell launches the same one, else None.

    Server start-up (~20-30 s on CPU) dominates short cells; cells differ only in what the server
    is sent, and each trainer syncs its own initial weights into the server before generating.
    Yields the ``rollout`` overrides that point a cell at it: its address and, when the server got a
    generated admin key, the variable that hands the key to the cells (set in this process only while
    the grid runs; the key is in no file).
    """
    first = cells[0].config
    # rollout.seed only seeds the client's per-request sampling seeds, so seeds may share a server
    same = {(c.config.rollout.model_dump_json(exclude={"seed"}), c.config.model.model_dump_json()) for c in cells}
    if first.rollout.addresses or len(same) > 1:
        yield None
        return

    init_dir = write_random_hf_checkpoint(first.model, out_dir / "server_init", seed=first.train.seed)
    startup = startup_timeout(first).value  # derived from the bytes to load when unset
    pool_scope = rollout_server_pool(first.rollout, init_dir, out_dir / "logs", startup_timeout_s=startup)
    with pool_scope as pool, _environ(pool.keys.server_env()):
        keyed = {"admin_api_key_env": RUN_ADMIN_KEY_ENV} if pool.keys.generated else {}
        yield {"addresses": pool.addresses, **keyed}


def run_ablation(
    config_path: str | Path, overrides: list[str] | None = None, out_dir: str | Path | None = None
) -> Path:
    """Train every valid cell in grid order, refresh the report after each, return ``report.md``.

    Cells run in this process one after another (``moe_rl.train.loop.train(cfg)``); a cell that raises is
    recorded in the report and the grid goes on, then ``AblationError`` lists the failures.
    """
    cells, out_dir = expand_grid(config_path, overrides, out_dir)

    notes = [f"skipped {_run_label(c)}: {c.skip_reason}" for c in cells if c.skip_reason]
    runnable = [c for c in cells if c.config is not None]
    settings = {c.name: c.settings for c in runnable}
    done: dict[str, list[Path]] = {}
    failures: list[str] = []
    if not runnable:
        raise ConfigError("every grid cell is invalid:\n  " + "\n  ".join(notes))
    report = out_dir / "report.md"
    with _shared_rollout_servers(runnable, out_dir) as shared:
        for i, cell in enumerate(runnable, 1):
            print(f"[ablate] run {i}/{len(runnable)}: {_run_label(cell)}", file=sys.stderr, flush=True)
            suffix = "" if cell.seed is None else f"__seed-{cell.seed}"
            save_config(cell.config, out_dir / "configs" / f"{cell.name}{suffix}.yaml")
            cfg = cell.config
            if shared:  # each cell loads its own initial weights into the shared server first
                cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=shared)})
            try:
                done.setdefault(cell.name, []).append(Path(train(cfg)))
            except Exception as exc:  # noqa: BLE001 -- one broken cell must not cost the rest of the grid
                failures.append(f"failed {_run_label(cell)}: {type(exc).__name__}: {exc}")
                done.setdefault(cell.name, []).append(cell.run_dir)  # whatever it logged before failing
            report = write_report(done, out_dir, settings, notes + failures)
    if failures:
        summary = f"{len(failures)} of {len(runnable)} cells failed (report: {report}):\n"
        raise AblationError(summary + "\n".join(failures))
    return report
