"""Rows of local dataset files: ``.jsonl``, ``.json`` (a list of objects, or ``{"data": [...]}``) and
``.parquet`` (pyarrow). Nothing is fetched: a path that is not a local file is an error.

Owns reading a file's rows, one at a time and in any order, with memory that does not grow with the
row contents (``open_rows``): a ``.jsonl`` file is indexed by one streamed pass over its bytes (the
offset of each non-blank line, checked to be UTF-8) and each row is parsed when asked for; a
``.parquet`` file is copied batch by batch into an Arrow IPC file in a cache directory and memory-mapped
(written once per source file version; ``pyarrow``); a ``.json`` file is one JSON document and is read
whole. Also owns looking up (dotted) keys in a row. Every failure is a ``DataError`` naming the file and
the line or row.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["MISSING", "DataError", "Rows", "first_row", "get_field", "open_rows", "read_rows"]

MISSING = object()
_CHUNK = 1 << 22  # bytes read per step of the jsonl index pass (its memory: a few times this)


class DataError(ValueError):
    """A dataset file or row that cannot be used; the message names the file (and row) and the key."""


class Rows:
    """A file's rows by index: ``len(rows)``, ``rows[i]`` (a dict) and ``rows.where(i)`` (file and row)."""

    path: Path

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> dict:
        raise NotImplementedError

    def where(self, i: int) -> str:
        return f"{self.path} row {i}"

    def _checked(self, i: int, row) -> dict:
        if not isinstance(row, dict):
            raise DataError(f"{self.where(i)} is a {type(row).__name__}; expected an object of named fields")
        return row


# ------------------------------------------------------------------------------------------- jsonl
def _line_number(path: Path, offset: int) -> int:
    """1-based line of byte ``offset`` (only on an error path: counts newlines before it)."""
    count, done = 1, 0
    with path.open("rb") as fh:
        while done < offset:
            chunk = fh.read(min(_CHUNK, offset - done))
            if not chunk:
                break
            count += chunk.count(b"\n")
            done += len(chunk)
    return count


class JsonlRows(Rows):
    """One row per non-blank line; the index holds each row's byte offset (8 bytes a row)."""

    def __init__(self, path: Path):
        self.path = path
        starts: list[np.ndarray] = []
        with path.open("rb") as fh:
            base, carry = 0, b""
            while True:
                block = fh.read(_CHUNK)
                data = carry + block
                cut = len(data) if not block else data.rfind(b"\n") + 1  # whole lines only (EOF: the rest)
                if cut == 0 and block:
                    carry = data
                    continue
                whole, carry = data[:cut], data[cut:]
                try:
                    whole.decode("utf-8")
                except UnicodeDecodeError as exc:
                    line = _line_number(path, base + exc.start)
                    byte = whole[exc.start : exc.start + 1].hex()
                    raise DataError(
                        f"{path}: line {line} is not valid UTF-8 ({exc.reason}: byte 0x{byte}); "
                        "expected a UTF-8 encoded .jsonl file"
                    ) from None
                starts.append(base + self._row_starts(whole))
                base += cut
                if not block:
                    break
        self.offsets = np.concatenate(starts) if starts else np.zeros(0, np.int64)

    @staticmethod
    def _row_starts(whole: bytes) -> np.ndarray:
        """Offsets (in ``whole``) of its lines that hold anything besides whitespace."""
        if not whole:
            return np.zeros(0, np.int64)
        b = np.frombuffer(whole, np.uint8)
        begins = np.concatenate([[0], np.flatnonzero(b[:-1] == 10) + 1]).astype(np.int64)  # each line >= 1 byte
        first = b[begins]
        keep = (first != 32) & ((first < 9) | (first > 13))  # starts with a non-space: not blank
        ends = np.append(begins[1:], len(b))
        for k in np.flatnonzero(~keep):  # lines starting with whitespace (rare): blank only if all of it is
            keep[k] = bool(whole[begins[k] : ends[k]].strip())
        return begins[keep]

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> dict:
        offset = int(self.offsets[i])
        with self.path.open("rb") as fh:
            fh.seek(offset)
            line = fh.readline()
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{self.path}: line {_line_number(self.path, offset)} is not valid JSON ({exc})") from None
        return self._checked(i, row)


# -------------------------------------------------------------------------------------------- json
class JsonRows(Rows):
    """A ``.json`` file: one document, read whole (use .jsonl or .parquet for large datasets)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not valid UTF-8 at byte {exc.start} ({exc.reason})") from None
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise DataError(
                f'{path}: expected a JSON list of row objects (or {{"data": [...]}}), got {type(data).__name__}'
            )
        self.rows = data

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self._checked(i, self.rows[i])


# ----------------------------------------------------------------------------------------- parquet
def _parquet_error(path: Path, exc: Exception) -> DataError:
    return DataError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})")


class ParquetRows(Rows):
    """A ``.parquet`` file through a memory-mapped Arrow copy: ``<cache_dir>/<stem>-<key>.arrow``, where the
    key hashes the source's path, size and modification time (a changed file is copied again)."""

    def __init__(self, path: Path, cache_dir: Path | None):
        self.path = path
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        cache_dir = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "moe_rl_data"
        self.copy = cache_dir / f"{path.stem}-{key}.arrow"
        if not self.copy.is_file():
            self._write_copy(pa, pq, cache_dir)
        self.table = pa.ipc.open_file(pa.memory_map(str(self.copy))).read_all()  # zero-copy: pages load on use

    def _write_copy(self, pa, pq, cache_dir: Path) -> None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{self.copy.name}.", suffix=".tmp")
        os.close(fd)
        try:
            try:
                # buffered page reads, one thread: a row group is decoded a page at a time, not held whole
                source = pq.ParquetFile(self.path, buffer_size=1 << 20, pre_buffer=False)
                with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, source.schema_arrow) as writer:
                    for batch in source.iter_batches(batch_size=8192, use_threads=False):
                        writer.write_batch(batch)
            except (OSError, ValueError, pa.ArrowException) as exc:
                raise _parquet_error(self.path, exc) from None
            os.replace(tmp, self.copy)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> dict:
        return self._checked(i, self.table.slice(int(i), 1).to_pylist()[0])


# ---------------------------------------------------------------------------------------------- api
def _local_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{path} does not exist or is not a file")
    return path


def open_rows(path: str | Path, cache_dir: str | Path | None = None) -> Rows:
    """The rows of one local dataset file, read on demand (``cache_dir``: where a parquet file's Arrow copy
    goes; default the system temp directory)."""
    path = _local_file(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return JsonlRows(path)
    if suffix == ".json":
        return JsonRows(path)
    if suffix == ".parquet":
        return ParquetRows(path, Path(cache_dir) if cache_dir is not None else None)
    raise DataError(f"{path}: unknown dataset format {suffix!r}; expected .jsonl, .json or .parquet")


def _first_rows(path: Path, limit: int) -> list:
    """The first ``limit`` rows without indexing or copying the whole file (the preflight's look)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            batch = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
        except Exception as exc:  # noqa: BLE001 -- pyarrow raises several types for a bad file
            raise _parquet_error(path, exc) from None
        return [] if batch is None else batch.to_pylist()
    if suffix == ".jsonl":
        rows = []
        with path.open("rb") as fh:
            for line_no, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(f"{path}: line {line_no} is not valid UTF-8 ({exc.reason})") from None
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: line {line_no} is not valid JSON ({exc})") from None
                if len(rows) >= limit:
                    break
        return rows
    rows = open_rows(path)
    return [rows[i] for i in range(min(limit, len(rows)))]


def read_rows(path: str | Path, limit: int | None = None) -> list[dict]:
    """The rows of one local dataset file (at most ``limit``), each a dict (small files and tests; a training
    run reads rows on demand through ``open_rows``)."""
    path = _local_file(path)
    if limit is not None:
        rows = _first_rows(path, limit)
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {i} is a {type(row).__name__}; expected an object of named fields")
        return rows
    with tempfile.TemporaryDirectory(prefix="moe_rl_rows_") as tmp:
        rows = open_rows(path, cache_dir=tmp)
        out = [rows[i] for i in range(len(rows))]
        if hasattr(rows, "table"):
            del rows.table
        return out


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
