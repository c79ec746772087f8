"""Rows of local dataset files: ``.jsonl``, ``.json`` (a list of objects, or ``{"data": [...]}``) and
``.parquet`` (pyarrow). Nothing is fetched: a path that is not a local file is an error.

Owns reading a file into a list of dict rows and looking up (dotted) keys in a row; every failure
is a ``DataError`` naming the file (and the row).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["DataError", "read_rows", "first_row", "get_field", "MISSING"]

MISSING = object()


class DataError(ValueError):
    """A dataset file or row that cannot be used; the message names the file (and row) and the key."""


def _jsonl(path: Path, limit: int | None) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {line_no} is not valid JSON ({exc})") from None
            if limit is not None and len(rows) >= limit:
                break
    return rows


def _json(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of row objects (or {{\"data\": [...]}}), got {type(data).__name__}")
    return data


def _parquet(path: Path, limit: int | None) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        if limit is not None:
            batch = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
            return [] if batch is None else batch.to_pylist()
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 -- pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from None


def read_rows(path: str | Path, limit: int | None = None) -> list[dict]:
    """The rows of one local dataset file (at most ``limit``), each a dict."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{path} does not exist or is not a file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _jsonl(path, limit)
    elif suffix == ".json":
        rows = _json(path)[:limit]
    elif suffix == ".parquet":
        rows = _parquet(path, limit)
    else:
        raise DataError(f"{path}: unknown dataset format {suffix!r}; expected .jsonl, .json or .parquet")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} is a {type(row).__name__}; expected an object of named fields")
    return rows


def first_row(path: str | Path) -> dict:
    """Row 0 of a dataset file (DataError when the file is empty)."""
    rows = read_rows(path, limit=1)
    if not rows:
        raise DataError(f"{path} has no rows")
    return rows[0]


def get_field(row: dict, key: str, default: Any = MISSING) -> Any:
    """``row[key]``, where a dotted key walks nested objects (``reward_model.ground_truth``)."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node
