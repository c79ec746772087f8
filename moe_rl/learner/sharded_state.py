"""Checkpoint state written in parallel: every rank writes the global-tensor chunks it owns, no rank gathers.

Owns format 4's tensor files. In a directory, ``<kind>-r<rank>.safetensors`` (kind ``model`` or
``optimizer``) is rank ``rank``'s file: a plain safetensors file whose header metadata holds the JSON
list of its chunks, each ``{"key", "name", "shape", "offsets", "box", "flat"}``: the tensor stored under
``key`` is the box of global tensor ``name`` (of ``shape``) at ``offsets`` with extent ``box`` — all of
it, or with ``flat = [a, b]`` elements ``a..b`` of the box flattened (a distributed-optimizer shard).
Who writes what is ``ownership``'s rule, so every global element is written exactly once and no rank
receives another's tensors; nothing passes through rank 0. The writer streams each tensor from the
rank's own memory into the file (no serialised copy of the state: the memory a save adds is one
tensor at most, for a non-contiguous one), then fsyncs.

``ShardedDir`` is the matching source for ``global_state.load_model`` / ``load_optimizer``: it reads
every rank file's header (JSON only), checks that every rank of the writing job left its file and
that each global tensor is covered exactly once (box arithmetic on the chunk index, no data), and gives
a rank its part of a global tensor (``part``: its tp/etp boxes, or a flat range of them) reading only
the byte ranges of the saved chunks that overlap it (``partial_read``); no global tensor is built
(``full`` assembles one, for tests and tools). Reading never runs code: safetensors headers are JSON
and the data raw bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from moe_rl.learner.checksums import HashingFile
from moe_rl.learner.global_state import (
    GlobalStateError,
    adam_state,
    model_tensors,
    named_slots,
)
from moe_rl.learner.ownership import Box, TensorSlice, local_slices, tp_rank_and_size, writes_whole
from moe_rl.learner.partial_read import check_cover, flat_boxes, read_runs

__all__ = [
    "SHARD_FORMAT",
    "ShardedDir",
    "rank_file",
    "read_global",
    "save_model_shards",
    "save_optimizer_shards",
    "write_rank_file",
    "write_safetensors",
]

SHARD_FORMAT = "moe_rl.sharded/1"
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_DTYPE = {v: k for k, v in _DTYPES.items()}
_RANK_FILE = re.compile(r"^(model|optimizer)-r(\d{5})\.safetensors$")

Entry = tuple[str, TensorSlice, torch.Tensor, "tuple[int, int] | None"]
"""``(global key, slice, tensor, flat range)``: the whole local tensor (range None), or the flat shard
``[a, b)`` of the flattened local tensor (``tensor`` then holds exactly those ``b - a`` elements)."""


def rank_file(directory: str | Path, kind: str, rank: int) -> Path:
    return Path(directory) / f"{kind}-r{rank:05d}.safetensors"


def write_safetensors(path: str | Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> dict:
    """Write ``tensors`` as one safetensors file, each streamed from its own memory (no serialised copy
    of the whole set, as ``safetensors.torch.save_file`` makes), then fsync; the file's checksum record
    (``checksums``: hashed from the same buffers as they are written). OSError propagates."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for key, t in tensors:
        if t.dtype not in _DTYPES:
            raise GlobalStateError(f"{key}: dtype {t.dtype} cannot be checkpointed; expected one of {list(_DTYPES)}")
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it
    with open(path, "wb") as fh:
        out = HashingFile(fh)
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for _, t in tensors:
            if t.numel():
                host = t.detach().to("cpu").contiguous()  # a copy only for a device or non-contiguous tensor
                out.write(host.reshape(-1).view(torch.uint8).numpy().data)
        fh.flush()
        os.fsync(fh.fileno())
    return out.record()


def _chunks(entries: Iterable[Entry]) -> tuple[list[tuple[str, torch.Tensor]], list[dict]]:
    tensors, index = [], []
    for key, s, t, flat in entries:
        if flat is None:
            pieces = [
                (box, None, t.reshape(box.shape) if not box.shape else t[box.row_start : box.row_stop])
                for box in s.boxes
            ]
        else:
            lo = flat[0]
            pieces = [
                (box, (a, b), t.reshape(-1)[start - lo : start - lo + (b - a)])
                for box, a, b, start in s.flat_pieces(*flat)
            ]
        for box, ab, data in pieces:
            name = f"{key}@{len(index)}"
            tensors.append((name, data))
            index.append(
                {
                    "key": name,
                    "name": key,
                    "shape": list(s.global_shape),
                    "offsets": list(box.offsets),
                    "box": list(box.shape),
                    "flat": list(ab) if ab else None,
                }
            )
    return tensors, index


def write_rank_file(
    directory: str | Path, kind: str, rank: int, world: int, entries: Iterable[Entry], bound: dict | None = None
) -> dict:
    """Write rank ``rank``'s (of ``world``) ``kind`` file: the chunks of ``entries`` and their JSON index, plus
    ``bound`` (``checksums.binding``: run id, step) in its metadata; returns the file's checksum record."""
    tensors, index = _chunks(entries)
    meta = (bound or {}) | {
        "format": SHARD_FORMAT,
        "kind": kind,
        "rank": str(rank),
        "world_size": str(world),
        "chunks": json.dumps(index),
    }
    return write_safetensors(rank_file(directory, kind, rank), tensors, meta)


def _save(directory: Path, kind: str, entries: Iterable[Entry], bound: dict | None) -> dict:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return write_rank_file(directory, kind, rank, world, entries, bound)


def save_model_shards(model, directory: str | Path, bound: dict | None = None) -> dict:
    """This rank writes ``model-r<rank>.safetensors`` with the model tensors it owns (no collective); ``bound``
    goes in its metadata; returns its checksum record."""
    tensors = {n: t.detach() for n, t in model_tensors(model).items()}
    slices = local_slices(model, tensors)
    mine = writes_whole(slices, {n: t.numel() * t.element_size() for n, t in tensors.items()})
    entries = ((slices[n].global_name, slices[n], tensors[n], None) for n in sorted(mine))
    return _save(Path(directory), "model", entries, bound)


def _step_slice(s: TensorSlice) -> TensorSlice:
    return TensorSlice(s.local_name, s.global_name, (1,), (Box(0, 1, (0,), (1,)),), False)


def save_optimizer_shards(optimizer, model, directory: str | Path, bound: dict | None = None) -> dict:
    """This rank writes ``optimizer-r<rank>.safetensors`` with the Adam state it owns (no collective); ``bound``
    goes in its metadata; returns its checksum record.

    Without the distributed optimizer that is the state of the parameters ``ownership.writes_whole``
    gives it; with it, this rank's flat shard of each parameter (tp/etp rank 0 only for a tp-replicated
    one), and the step from the rank whose shard starts the parameter.
    """
    slots = dict(named_slots(optimizer, model))
    slices = local_slices(model, {n: s.param for n, s in slots.items()})
    sizes = {n: s.param.numel() * s.param.element_size() for n, s in slots.items()}
    whole = writes_whole({n: s for n, s in slices.items() if slots[n].flat_range is None}, sizes)
    entries: list[Entry] = []
    for name in sorted(slots):
        slot, s = slots[name], slices[name]
        if slot.flat_range is None and name not in whole:
            continue
        if slot.flat_range is not None and not s.split and tp_rank_and_size(s.global_name)[0] != 0:
            continue
        state = adam_state(name, slot)
        for key in ("exp_avg", "exp_avg_sq"):
            entries.append((f"{key}/{s.global_name}", s, state[key], slot.flat_range))
        if slot.separate_main:
            entries.append((f"main/{s.global_name}", s, slot.main, slot.flat_range))
        if slot.flat_range is None or slot.flat_range[0] == 0:
            entries.append((f"step/{s.global_name}", _step_slice(s), state["step"], None))
    return _save(Path(directory), "optimizer", entries, bound)


class ShardedDir:
    """Source of global tensors (``keys``, ``shape(key)``, ``part(key, slice, flat)``, ``full(key)``) over the ``<kind>-r*.safetensors`` files of a directory.

    GlobalStateError when a rank's file is missing or unreadable, was written for another kind or job
    size, or a global tensor is not covered exactly once by the chunks (checked from the headers at open).
    ``bytes_read``: tensor bytes this instance materialised; ``process_bytes_read``: all instances' (benchmarks).
    """

    process_bytes_read = 0

    def __init__(self, directory: str | Path, kind: str):
        self.where = Path(directory) / f"{kind}-r*.safetensors"
        files = sorted(p for p in Path(directory).glob(f"{kind}-r*.safetensors") if _RANK_FILE.match(p.name))
        if not files:
            raise GlobalStateError(f"{self.where}: no {kind} rank files; not a format-4 checkpoint directory")
        self.handles, self.chunks, worlds = [], {}, set()
        for path in files:
            try:
                fh = safe_open(str(path), framework="pt", device="cpu")
                meta = fh.metadata() or {}
                index = json.loads(meta.get("chunks", "null"))
            except (SafetensorError, OSError, ValueError) as exc:
                raise GlobalStateError(f"{path} is not a readable safetensors rank file ({exc})") from None
            if meta.get("format") != SHARD_FORMAT or meta.get("kind") != kind or not isinstance(index, list):
                raise GlobalStateError(
                    f"{path} has format {meta.get('format')!r} / kind {meta.get('kind')!r}; "
                    f"expected {SHARD_FORMAT!r} / {kind!r}"
                )
            worlds.add(meta.get("world_size"))
            self.handles.append(fh)
            for c in index:
                self.chunks.setdefault(c["name"], []).append((fh, c))
        if len(worlds) != 1 or not str(next(iter(worlds))).isdigit() or int(next(iter(worlds))) != len(files):
            raise GlobalStateError(
                f"{self.where}: {len(files)} rank files for a job of {sorted(map(str, worlds))} "
                "ranks; a rank's file is missing"
            )
        self.keys, self.bytes_read = set(self.chunks), 0
        self.files = {id(fh): path for fh, path in zip(self.handles, files, strict=True)}
        for key in sorted(self.keys):
            try:
                self._check(key)
            except (KeyError, TypeError, ValueError, SafetensorError) as exc:
                raise GlobalStateError(f"{self.where}: the chunk index of {key} is unreadable ({exc!r})") from None

    def shape(self, key: str) -> tuple[int, ...]:
        """The global shape of ``key`` (from the headers)."""
        return tuple(self.chunks[key][0][1]["shape"])

    def full(self, key: str) -> torch.Tensor:
        """Global tensor ``key`` assembled from its chunks (one global tensor in memory: tests, tools)."""
        shape = self.shape(key)
        return self.part(
            key, TensorSlice(key, key, shape, (Box(0, shape[0] if shape else 1, (0,) * len(shape), shape),), False)
        )

    def part(self, key: str, s: TensorSlice, flat: tuple[int, int] | None = None) -> torch.Tensor:
        """This rank's part of global tensor ``key``: the boxes of ``s`` (shaped as the local tensor), or with
        ``flat = (lo, hi)`` elements ``lo..hi`` of it flattened (1-d). Reads only the bytes of the saved chunks
        that overlap it (``partial_read``), counted in ``bytes_read``; no global tensor is built."""
        shape = self.shape(key)
        if s.global_shape != shape:
            raise GlobalStateError(f"{self.where}: {key} is saved as {shape}, not {s.global_shape}")
        pieces = [(b, 0, b.numel) for b in s.boxes] if flat is None else [p[:3] for p in s.flat_pieces(*flat)]
        request, at = [], 0
        for box, a, b in pieces:
            request += [
                (tuple(o + x for o, x in zip(box.offsets, off, strict=True)), ext, at + f - a)
                for off, ext, f in flat_boxes(box.shape, a, b)
            ]
            at += b - a
        rows = sum(b.row_stop - b.row_start for b in s.boxes)
        local = (at,) if flat else (rows, *s.boxes[0].shape[1:]) if shape else ()
        dtype = self._dtype(key)
        out = torch.empty(at, dtype=dtype, device="cpu")
        got = read_runs(request, [r for fh, c in self.chunks[key] for r in self._runs(fh, c, dtype)], out)
        if got != at:  # the chunks partition the tensor (checked at open): a request outside it
            raise GlobalStateError(f"{self.where}: {key}: {at - got} of this rank's elements are in no saved chunk")
        return out.view(local)

    def _dtype(self, key: str) -> torch.dtype:
        fh, c = self.chunks[key][0]
        return _FROM_DTYPE.get(fh.get_slice(c["key"]).get_dtype(), torch.float32)

    def _slice(self, fh, c: dict, dtype: torch.dtype):
        """The stored tensor of chunk ``c`` (a ``get_slice`` handle, nothing read), checked against its index entry."""
        sl = fh.get_slice(c["key"])
        stored, kind = tuple(sl.get_shape()), _FROM_DTYPE.get(sl.get_dtype())
        want = (c["flat"][1] - c["flat"][0],) if c["flat"] else tuple(c["box"])
        if stored != want or kind != dtype:
            raise GlobalStateError(
                f"{self.files[id(fh)]}: chunk {c['key']} of {c['name']} holds {stored} {sl.get_dtype()} for a box "
                f"{c['box']} (flat {c['flat']}) of {dtype}; the file's chunk index is corrupt"
            )
        return sl

    def _runs(self, fh, c: dict, dtype: torch.dtype) -> list:
        """A chunk as ``partial_read`` runs, each with its reader (checking the stored tensor, counting the bytes)."""
        offsets, box = tuple(c["offsets"]), tuple(c["box"])

        def count(t: torch.Tensor) -> torch.Tensor:
            self.bytes_read += t.numel() * t.element_size()
            ShardedDir.process_bytes_read += t.numel() * t.element_size()
            return t

        def whole(region: tuple) -> torch.Tensor:
            sl = self._slice(fh, c, dtype)
            return count(sl[region] if box else fh.get_tensor(c["key"]))  # 0-d: get_slice takes no index

        if c["flat"] is None:
            return [((offsets, box, 0), -1, whole)]
        a, _ = c["flat"]

        def ranges(spans: list[tuple[int, int]]) -> torch.Tensor:
            sl = self._slice(fh, c, dtype)
            return torch.cat([count(sl[s : s + n]) for s, n in spans])

        return [
            ((tuple(o + x for o, x in zip(offsets, off, strict=True)), ext, f), f - a, ranges)
            for off, ext, f in flat_boxes(box, *c["flat"])
        ]

    def _check(self, key: str) -> None:
        """The chunks of ``key`` cover the global tensor exactly once (from the chunk index: no data read)."""
        shape, chunks = self.shape(key), []
        for fh, c in self.chunks[key]:
            label = f"{self.files[id(fh)].name}:{c['key']}"
            if tuple(c["shape"]) != shape:
                raise GlobalStateError(f"{label}: a chunk of {key} of shape {c['shape']}, others say {shape}")
            a, b = c["flat"] or (0, math.prod(c["box"]))
            chunks.append((tuple(c["offsets"]), tuple(c["box"]), int(a), int(b), label))
        if problem := check_cover(shape, chunks):
            raise GlobalStateError(
                f"{self.where}: {key} is not covered exactly once by the saved chunks "
                f"({problem}); the checkpoint is incomplete or corrupt"
            )


def read_global(directory: str | Path, kind: str) -> dict[str, torch.Tensor]:
    """Every global tensor of a format-4 directory, whole (tests, tools; a whole model in memory)."""
    src = ShardedDir(directory, kind)
    return {k: src.full(k) for k in sorted(src.keys)}
