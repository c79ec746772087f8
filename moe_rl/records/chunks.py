"""Records format 3: integrity per chunk, and reading only some samples' bytes of a records file.

Owns the chunk layout of a records file and its byte-range reader (``batch.py`` owns the arrays and the
format; ``share.py`` builds a batch from what this reads). The arrays stay columnar, as in formats 1-2;
their rows fall into three kinds:

- per sample (``PER_SAMPLE``: lengths, rewards, groups, dataset rows): one row per sample, read by every
  rank; one chunk ``samples``;
- per response token, read by every rank (``SHARED``: the behaviour log-probs and token versions, which
  the step-global statistics need for every sample of a minibatch, and format 4's trajectory masks and turn
  ids, which decide which tokens the loss and its step-global denominator count): one chunk per array;
- a sample's own rows (``LOCAL``: its token ids, routes and kept sets, the bulk of a file): chunk
  ``sample <i>`` is sample ``i``'s rows of every local array, back to back, read only by the rank that
  trains on it.

The moe_rl metadata carries ``chunks``: ``{"meta": d, "shared": {name: d}, "samples": [d_0, ...]}``, each
``d`` the sha256 (first 32 hex) of the chunk's bytes (``meta``: of the rest of the metadata, as canonical
JSON). The header, which holds every digest, is what ranks compare to know they read one file.
``RecordsFile`` reads the header and byte ranges with ``os.pread``, counting every byte it reads.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Self

import numpy as np

from moe_rl.records.routes import RecordError

__all__ = [
    "LOCAL",
    "PER_SAMPLE",
    "SHARED",
    "RecordMismatch",
    "RecordsFile",
    "chunk_index",
    "digest",
    "local_spans",
    "verify_chunks",
]

PER_SAMPLE = ("prompt_lens", "response_lens", "rewards", "group_ids", "data_rows", "data_file_ids")
SHARED = ("rollout_logp", "sampling_logp", "token_versions", "role_mask", "loss_mask", "turn_ids")
LOCAL = ("prompt_ids", "response_ids", "routes", "mask_offsets", "mask_ids")
MAX_HEADER = 256 << 20  # a header (JSON: names, shapes, per-sample metadata and digests) larger than this is refused
_DTYPES = {
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "BOOL": np.bool_,
}


class RecordMismatch(RecordError):
    """This rank's file is not the one rank 0 read (its header digest differs)."""


def digest(*parts: np.ndarray | bytes) -> str:
    """sha256 (first 32 hex) of ``parts``' bytes back to back (arrays in C order, as stored)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else memoryview(np.ascontiguousarray(p)).cast("B"))
    return h.hexdigest()[:32]


def _meta_digest(meta: dict) -> str:
    return digest(json.dumps({k: v for k, v in meta.items() if k != "chunks"}, sort_keys=True).encode())


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def local_spans(prompt_lens: np.ndarray, response_lens: np.ndarray) -> dict[str, np.ndarray]:
    """Per local array (but ``mask_ids``, which ``mask_offsets`` locates), the row offsets of each sample:
    sample ``i`` holds rows ``[o[i], o[i + 1])`` (``mask_offsets``: ``[o[i], o[i + 1] + 1)``)."""
    p, r = prompt_lens.astype(np.int64), response_lens.astype(np.int64)
    rows = _offsets(r)
    return {"prompt_ids": _offsets(p), "response_ids": rows, "routes": _offsets(p + r - 1), "mask_offsets": rows}


def _sample_slices(arrays: dict, spans: dict, i: int) -> list[np.ndarray]:
    """Sample ``i``'s rows of every local array present in ``arrays`` (whole arrays), in ``LOCAL`` order."""
    out = []
    for name in LOCAL:
        arr = arrays.get(name)
        if arr is None:
            continue
        if name == "mask_ids":
            mo = arrays["mask_offsets"]
            r = spans["mask_offsets"]
            out.append(arr[mo[r[i]] : mo[r[i + 1]]])
        else:
            o = spans[name]
            out.append(arr[o[i] : o[i + 1] + (name == "mask_offsets")])
    return out


def chunk_index(arrays: dict, meta: dict) -> dict:
    """The ``chunks`` metadata of a file holding ``arrays`` (whole) and ``meta`` (without ``chunks``)."""
    spans = local_spans(arrays["prompt_lens"], arrays["response_lens"])
    shared = {"samples": digest(*(arrays[k] for k in PER_SAMPLE if k in arrays))}
    shared |= {k: digest(arrays[k]) for k in SHARED if k in arrays}
    n = len(arrays["prompt_lens"])
    return {
        "meta": _meta_digest(json.loads(json.dumps(meta))),  # as a reader will parse it
        "shared": shared,
        "samples": [digest(*_sample_slices(arrays, spans, i)) for i in range(n)],
    }


def _refuse(chunk: str, got: str, want) -> None:
    raise RecordError(
        f"chunk {chunk!r} has sha256 {got}, the file's index says {want}: the chunk changed after it was "
        f"written (a damaged or edited file); regenerate or restore it"
    )


def _check_index(chunks, n: int | None = None) -> dict:
    if not (
        isinstance(chunks, dict)
        and isinstance(chunks.get("shared"), dict)
        and isinstance(chunks.get("samples"), list)
        and (n is None or len(chunks["samples"]) == n)
    ):
        each = "one 'samples' digest per sample" + ("" if n is None else f" ({n})")
        raise RecordError(f"format 3 metadata must hold chunks with 'meta', 'shared' and {each}")
    return chunks


def verify_chunks(arrays: dict, meta: dict) -> None:
    """Every chunk of a whole file read into ``arrays`` against ``meta["chunks"]``; ``RecordError`` naming the
    first chunk whose bytes differ."""
    index = _check_index(meta.get("chunks"), len(arrays["prompt_lens"]))
    found = chunk_index(arrays, meta)
    if found["meta"] != index.get("meta"):
        _refuse("meta", found["meta"], index.get("meta"))
    for name, d in found["shared"].items():
        if d != index["shared"].get(name):
            _refuse(name, d, index["shared"].get(name))
    for i, (d, want) in enumerate(zip(found["samples"], index["samples"])):
        if d != want:
            _refuse(f"sample {i}", d, want)


class RecordsFile:
    """One records file opened for partial reads: its header (parsed, and its digest ``identity``), then
    byte ranges on request; ``bytes_read`` counts every byte read from the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.bytes_read = 0
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.size = os.fstat(self._fd).st_size
            n = int.from_bytes(self._pread(0, 8), "little") if self.size >= 8 else -1
            if not 0 < n <= min(MAX_HEADER, self.size - 8):
                raise RecordError("not a safetensors file (bad header length)")
            raw = self._pread(8, n)
            self.identity = digest(raw)
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise RecordError("not a safetensors file (its header is not a JSON object)")
            self.metadata = header.pop("__metadata__", None) or {}
            self._tensors = {name: self._entry(name, spec, 8 + n) for name, spec in header.items()}
        except BaseException:
            os.close(self._fd)
            raise

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _pread(self, offset: int, size: int) -> bytes:  # the header
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise RecordError(f"truncated: {size} bytes at offset {offset} asked, {len(data)} read")
        self.bytes_read += size
        return data

    def _entry(self, name: str, spec, base: int):
        try:
            dtype = np.dtype(_DTYPES[spec["dtype"]])
            shape = tuple(int(s) for s in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise RecordError(f"tensor {name!r} has a malformed header entry {spec!r}") from None
        size = int(np.prod(shape)) * dtype.itemsize
        if min(shape, default=0) < 0 or begin < 0 or end - begin != size or base + end > self.size:
            raise RecordError(f"tensor {name!r}: its header entry does not fit the file ({spec!r})")
        return dtype, shape, base + begin

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name][1]

    def rows(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` (along dim 0) of array ``name``, read from the file (into ``out``, a C-contiguous
        array of those rows' shape and dtype, when given: no second copy)."""
        dtype, shape, at = self._tensors[name]
        if not shape or not 0 <= start <= stop <= shape[0]:
            raise RecordError(f"{name} has shape {list(shape)}; rows [{start}, {stop}) asked")
        row = int(np.prod(shape[1:])) * dtype.itemsize
        if out is None:
            out = np.empty((stop - start, *shape[1:]), dtype)
        size = (stop - start) * row
        got = os.preadv(self._fd, [memoryview(out).cast("B")], at + start * row) if size else 0
        if got != size:
            raise RecordError(f"truncated: {size} bytes at offset {at + start * row} asked, {got} read")
        self.bytes_read += size
        return out

    def whole(self, name: str) -> np.ndarray:
        if not self.shape(name):
            raise RecordError(f"{name} must be an array, got a scalar")
        return self.rows(name, 0, self.shape(name)[0])

    def shared(self, meta: dict, names=SHARED) -> dict[str, np.ndarray]:
        """The per-sample arrays and the shared per-token arrays ``names`` (those the file has), each chunk
        checked against ``meta["chunks"]``."""
        _check_index(meta.get("chunks"))
        if (d := _meta_digest(meta)) != meta["chunks"].get("meta"):
            _refuse("meta", d, meta["chunks"].get("meta"))
        arrays = {k: self.whole(k) for k in (*PER_SAMPLE, *names) if k in self}
        want = meta["chunks"]["shared"]
        if (d := digest(*(arrays[k] for k in PER_SAMPLE if k in arrays))) != want.get("samples"):
            _refuse("samples", d, want.get("samples"))
        for k in names:
            if k in arrays and (d := digest(arrays[k])) != want.get(k):
                _refuse(k, d, want.get(k))
        return arrays

    def samples(self, ids, prompt_lens: np.ndarray, response_lens: np.ndarray, meta: dict) -> dict[str, np.ndarray]:
        """Local arrays of samples ``ids`` (in that order, back to back; ``mask_offsets`` rebased to this
        selection), each sample's chunk checked against ``meta["chunks"]["samples"]``. The rows are read
        straight into the arrays returned (the kept sets' offsets first, to size them)."""
        spans, want = local_spans(prompt_lens, response_lens), _check_index(meta["chunks"], len(prompt_lens))
        names = [k for k in LOCAL if k in self]
        offs: dict[int, np.ndarray] = {}  # per sample: its mask_offsets rows (one more than its tokens)
        try:
            for i in ids if "mask_offsets" in names else ():
                o = spans["mask_offsets"]
                offs[i] = self.rows("mask_offsets", int(o[i]), int(o[i + 1]) + 1)
                if offs[i][-1] < offs[i][0]:
                    raise RecordError("mask_offsets decrease")
        except RecordError as exc:
            raise RecordError(f"chunk 'sample {i}': {exc}") from None

        def extent(name: str, i: int) -> tuple[int, int]:
            if name == "mask_ids":
                return int(offs[i][0]), int(offs[i][-1])
            return int(spans[name][i]), int(spans[name][i + 1])

        out, pos = {}, dict.fromkeys(names, 0)
        for name in names:
            if name != "mask_offsets":
                rows = sum(b - a for a, b in (extent(name, i) for i in ids))
                out[name] = np.empty((rows, *self.shape(name)[1:]), self._tensors[name][0])
        for i in ids:
            parts = []
            try:
                for name in names:
                    if name == "mask_offsets":
                        parts.append(offs[i])
                        continue
                    a, b = extent(name, i)
                    parts.append(self.rows(name, a, b, out[name][pos[name] : pos[name] + b - a]))
                    pos[name] += b - a
            except RecordError as exc:
                raise RecordError(f"chunk 'sample {i}': {exc}") from None
            if (d := digest(*parts)) != want["samples"][i]:
                _refuse(f"sample {i}", d, want["samples"][i])
        if "mask_offsets" in names:  # rebased: the held samples' kept sets back to back
            sizes = [np.diff(offs[i]) for i in ids]
            flat = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
            out["mask_offsets"] = np.concatenate([[0], np.cumsum(flat)]).astype(np.int64)
        return out
