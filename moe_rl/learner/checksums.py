"""Checkpoint files bound to their save: sha256 checksums taken while a file is written, verified on load.

Owns format 5's integrity record (``checkpoint`` owns the layout and the fallback). Every file of a save is
written through ``HashingFile``, which feeds each buffer to sha256 on its way to the file, one digest per
``CHUNK_BYTES`` (64 MiB) chunk, so the data is hashed once, from the memory it is written from, never read
back; the file's digest is the sha256 of its chunk digests (``top_digest``: one pass over the data, not
two, which a separate whole-file sha256 would cost). The records of every rank's files go into the
save's ``meta.json`` (written last) as ``{"algorithm": "sha256", "chunk_bytes": C, "files": {name: {"bytes",
"sha256", "chunks": [...]}}}``. The learner's own safetensors files also carry ``run_id`` and ``step`` in
their ``__metadata__`` (``binding``), so a file of another run or another save is told apart by its header
alone. ``verify_file`` reads a file once in chunks and raises ``DamagedCheckpoint`` naming the file and what
differed: its run id / step against ``meta.json``'s, its size, or the first chunk whose digest differs (with
its byte range). Only the chunk digests are compared on load: equal chunks and size give an equal file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "ALGORITHM",
    "CHUNK_BYTES",
    "DamagedCheckpoint",
    "HashingFile",
    "binding",
    "checksum_table",
    "hashed_copy",
    "hashed_write",
    "top_digest",
    "verify_file",
    "verify_save",
]

ALGORITHM = "sha256"
CHUNK_BYTES = 64 << 20  # 64 MiB: ~7,000 digests (< 1 MB of meta.json) for a 30B model's weights + Adam state


_BOUND_FILE = re.compile(r"^(?:model-r|optimizer-r|rank_)(\d{5})\.safetensors$")  # the learner's own files


class DamagedCheckpoint(ValueError):
    """A checkpoint file differs from what its save recorded (another run's or save's file, or changed bytes)."""


def binding(run_id: str | None, step: int) -> dict[str, str]:
    """The ``__metadata__`` entries that bind a safetensors file to its save."""
    return {"run_id": run_id or "", "step": str(int(step))}


class HashingFile:
    """A binary file opened for writing whose every written byte also goes to the chunk digests."""

    def __init__(self, fh, chunk_bytes: int | None = None):
        self.fh, self.chunk_bytes = fh, chunk_bytes or CHUNK_BYTES
        self.chunk, self.chunks = hashlib.sha256(), []
        self.size = self.filled = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.fh.write(view)
        self.size += len(view)
        self._hash(view)

    def _hash(self, view: memoryview) -> None:
        while len(view):
            take = min(len(view), self.chunk_bytes - self.filled)
            self.chunk.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == self.chunk_bytes:
                self.chunks.append(self.chunk.hexdigest())
                self.chunk, self.filled = hashlib.sha256(), 0

    def record(self) -> dict:
        """``{"bytes", "sha256", "chunks"}`` of everything written (call once, after the last write)."""
        chunks = self.chunks + ([self.chunk.hexdigest()] if self.filled or not self.chunks else [])
        return {"bytes": self.size, ALGORITHM: top_digest(chunks), "chunks": chunks}


def top_digest(chunks: list[str]) -> str:
    """A file's digest: sha256 of its chunk digests (32 bytes each, in order)."""
    return hashlib.sha256(b"".join(bytes.fromhex(c) for c in chunks)).hexdigest()


def hashed_write(path: str | Path, pieces: Iterable, chunk_bytes: int | None = None) -> dict:
    """Write ``pieces`` (bytes-like) to ``path``, fsync, return the file's record. OSError propagates."""
    with open(path, "wb") as fh:
        out = HashingFile(fh, chunk_bytes)
        for piece in pieces:
            out.write(piece)
        fh.flush()
        os.fsync(fh.fileno())
    return out.record()


def hashed_copy(source: str | Path, dest: str | Path, chunk_bytes: int | None = None) -> dict:
    """Copy ``source`` to ``dest`` in chunks, hashing what is written; the record of ``dest``."""

    def pieces():
        with open(source, "rb") as fh:
            while block := fh.read(chunk_bytes or CHUNK_BYTES):
                yield block

    return hashed_write(dest, pieces(), chunk_bytes)


def checksum_table(records: dict[str, dict]) -> dict:
    """``meta.json``'s ``checksums`` entry for ``{file name (relative to the step dir): record}``."""
    return {"algorithm": ALGORITHM, "chunk_bytes": CHUNK_BYTES, "files": dict(sorted(records.items()))}


def _header_binding(path: Path) -> dict:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(min(n, 100 << 20)))
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def _check_binding(path: Path, run_id: str | None, step: int) -> None:
    try:
        found = _header_binding(path)
    except (OSError, ValueError, struct.error) as exc:
        raise DamagedCheckpoint(f"{path}: its safetensors header is unreadable ({exc})") from None
    want = binding(run_id, step)
    got = {k: found.get(k) for k in want}
    if got != want:
        found_text = (
            "carries no run id / step in its header"
            if got["run_id"] is None and got["step"] is None
            else f"was written by run {got['run_id']!r} at step {got['step']}"
        )
        raise DamagedCheckpoint(
            f"{path} {found_text}, but meta.json names run {want['run_id']!r} at step {want['step']} "
            "(a file of another run or save)"
        )


def verify_file(path: str | Path, record: dict, chunk_bytes: int, bound: tuple[str | None, int] | None = None) -> None:
    """DamagedCheckpoint unless ``path`` has ``record``'s size and chunk digests (and, with ``bound``
    ``(run_id, step)``, those in its safetensors header). Reads the file once, one chunk at a time."""
    path = Path(path)
    if bound is not None:
        _check_binding(path, *bound)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DamagedCheckpoint(f"{path} is missing or unreadable ({exc.strerror or exc})") from None
    if size != record.get("bytes"):
        raise DamagedCheckpoint(f"{path} has {size} bytes; meta.json recorded {record.get('bytes')}")
    want = record.get("chunks") or []
    try:
        consistent = len(want) == max(1, -(-size // chunk_bytes)) and top_digest(want) == record.get(ALGORITHM)
    except (TypeError, ValueError):
        consistent = False
    if not consistent:
        raise DamagedCheckpoint(f"{path}: meta.json's checksums of this file do not add up; meta.json is damaged")
    buf = bytearray(min(chunk_bytes, max(size, 1)))
    view = memoryview(buf)
    with open(path, "rb") as fh:
        for i, digest in enumerate(want):
            n = fh.readinto(view)
            if hashlib.sha256(view[:n]).hexdigest() != digest:
                lo = i * chunk_bytes
                raise DamagedCheckpoint(
                    f"{path}: chunk {i} (bytes {lo}-{lo + max(n, 1) - 1} of {size}) has another {ALGORITHM} "
                    f"than meta.json recorded; the file's data changed after it was saved"
                )


def _owner(name: str) -> int | None:
    """The saving rank of one of the learner's own (bound) files, None for a carried file."""
    m = _BOUND_FILE.match(name)
    return int(m.group(1)) if m else None


def verify_save(d: str | Path, meta: dict, rank: int, world: int) -> None:
    """Verify this rank's share of step dir ``d``'s files against ``meta`` (a format-5 ``meta.json``): the
    files saved by rank ``r`` are verified by rank ``r % world`` (on the saving layout, each rank its own;
    carried files by rank 0), so every file is read once. DamagedCheckpoint naming the first difference."""
    d = Path(d)
    table = meta.get("checksums")
    files = table.get("files") if isinstance(table, dict) else None
    chunk_bytes = table.get("chunk_bytes") if isinstance(table, dict) else None
    if not isinstance(files, dict) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise DamagedCheckpoint(f"{d / 'meta.json'} has no readable checksums table; meta.json is damaged")
    if rank == 0:
        unrecorded = sorted(p.name for p in d.glob("*.safetensors") if _owner(p.name) is not None)
        unrecorded = [n for n in unrecorded if n not in files]
        if unrecorded:
            raise DamagedCheckpoint(f"{d / unrecorded[0]} is not recorded in meta.json; it is not from this save")
    for name, record in sorted(files.items()):
        owner = _owner(name)
        if (0 if owner is None else owner) % world != rank:
            continue
        if ".." in Path(name).parts or Path(name).is_absolute() or not isinstance(record, dict):
            raise DamagedCheckpoint(f"{d / 'meta.json'} records an invalid file entry {name!r}; meta.json is damaged")
        verify_file(d / name, record, chunk_bytes, None if owner is None else (meta.get("run_id"), meta["step"]))
