"""Per-rank HF import: read only the byte ranges of an HF safetensors checkpoint this rank's model holds.

Owns ``load_hf_weights`` (``checkpoint.init_from_hf``) and the counting reader it goes through
(``HFReader``). For every tensor of this rank's model (its pipeline stage's layers, its experts under ep,
its tp/etp rows or columns) the import looks up the HF tensors it is made of (``hf_convert.hf_name_map``),
checks shapes from the safetensors headers, and ``get_slice``s only this rank's part of each:

* a plain copy: whole, or this rank's rows (``linear_qkv``-like column splits, embeddings, ``output_layer``)
  or columns (``linear_proj``, ``linear_fc2``);
* ``linear_fc1`` (SwiGLU): this rank's rows of ``gate_proj`` and of ``up_proj``, concatenated gate first;
* ``linear_qkv`` weight/bias: this rank's query groups' rows of ``q_proj``, ``k_proj``, ``v_proj``, packed
  per group ``[q_g; k_g; v_g]``.

One HF tensor at a time is materialised (plus its packed copy), so the host memory the import adds over the
model is O(largest tensor), and the bytes read per rank are this rank's parameters in the file's dtype. The
reader counts the tensor bytes it materialises per file (``HFReadStats``), the figure the tests and
``bench/bench_hf_import.py`` check. The tensors equal, bit for bit, what slicing the whole converted
checkpoint (``hf_convert.hf_to_megatron`` + ``tp_shards.tp_slice``, the former import) gives.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import torch
from safetensors import SafetensorError, safe_open

from moe_rl.learner.hf_convert import hf_name_map
from moe_rl.learner.model import unwrap
from moe_rl.learner.ownership import global_name, local_expert_range, stage_layer_offset, tp_rank_and_size
from moe_rl.learner.tp_shards import tp_split_dim

__all__ = ["HFReadStats", "HFReader", "ReadTarget", "load_hf_weights", "read_plan", "read_target"]

_INDEX = "model.safetensors.index.json"


@dataclass
class HFReadStats:
    """Tensor bytes materialised per file, and each read as ``(hf name, dim or None = whole, start, stop)``."""

    bytes_by_file: dict[str, int] = field(default_factory=dict)
    reads: list[tuple[str, int | None, int, int]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_file.values())


class HFReader:
    """Open an HF safetensors dir (``model.safetensors.index.json`` or one ``model.safetensors``) for slicing.

    Use as a context manager; files are opened (memory-mapped, nothing read) when first needed."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.stats = HFReadStats()
        self._stack = ExitStack()
        self._files: dict[str, object] = {}
        index = self.dir / _INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
            self.weight_map: dict[str, str] = dict(weight_map)
            for f in sorted(set(self.weight_map.values())):
                if not (self.dir / f).is_file():
                    raise FileNotFoundError(f"{index} names {f!r}, which is not in {self.dir}")
        elif (self.dir / "model.safetensors").exists():
            self.weight_map = dict.fromkeys(self._open("model.safetensors").keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"{self.dir} has neither model.safetensors nor {_INDEX}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _open(self, file: str):
        if file not in self._files:
            try:
                self._files[file] = self._stack.enter_context(safe_open(self.dir / file, framework="pt", device="cpu"))
            except (OSError, SafetensorError) as e:
                raise ValueError(f"{self.dir / file}: not a readable safetensors file ({e})") from None
        return self._files[file]

    def _slice(self, name: str):
        return self._open(self.weight_map[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """Tensor ``name`` whole (``dim`` None) or its indices ``[start, stop)`` along ``dim`` (0 or 1)."""
        if dim is None:
            t = self._open(self.weight_map[name]).get_tensor(name)
        elif dim == 0:
            t = self._slice(name)[start:stop]
        else:
            t = self._slice(name)[:, start:stop]
        file = self.weight_map[name]
        self.stats.bytes_by_file[file] = self.stats.bytes_by_file.get(file, 0) + t.numel() * t.element_size()
        self.stats.reads.append((name, dim, start, stop))
        return t


def _pack_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Rows of ``groups`` query groups of q, k, v -> Megatron's ``[q_g; k_g; v_g]`` per group (as ``_pack_qkv``)."""
    tail = q.shape[1:]
    per_group = torch.cat([t.reshape(groups, -1, *tail) for t in (q, k, v)], dim=1)
    return per_group.reshape(-1, *tail)


def _full_shape(kind: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of the converted (Megatron, tp=1) tensor made of HF tensors of ``shapes``."""
    if kind == "copy":
        return shapes[0]
    return (sum(s[0] for s in shapes), *shapes[0][1:])


@dataclass(frozen=True)
class ReadTarget:
    """One state-dict tensor of this rank: the HF tensors it is made of and its tp split."""

    local: str  # this rank's state-dict name
    src: str  # global Megatron name
    kind: str
    hf: tuple[str, ...]
    dim: int | None  # tp split dim (None: whole)
    rank: int
    size: int


def read_plan(model, model_cfg) -> list[ReadTarget]:
    """This rank's state-dict tensors that come from the HF checkpoint, with what to read for each."""
    names = hf_name_map(model_cfg)
    start, _ = local_expert_range(model)
    offset = stage_layer_offset(model)
    out = []
    for name in unwrap(model).state_dict():
        src = global_name(name, start, offset)
        if src not in names:
            continue
        kind, hf = names[src]
        rank, size = tp_rank_and_size(src)
        dim = tp_split_dim(src)[0] if size > 1 else None
        out.append(ReadTarget(name, src, kind, hf, dim, rank, size))
    return out


def _local_shape(t: ReadTarget, full: tuple[int, ...]) -> tuple[int, ...]:
    if t.dim is None:
        return full
    swiglu = t.kind == "fc1"
    if full[t.dim] % (2 * t.size if swiglu else t.size):
        raise ValueError(f"{t.src}: dim {t.dim} of shape {full} does not split into {t.size} tp shards")
    return tuple(n // t.size if d == t.dim else n for d, n in enumerate(full))


def read_target(reader: HFReader, t: ReadTarget, model_cfg) -> torch.Tensor:
    """The part of Megatron tensor ``t.src`` that tp rank ``t.rank`` of ``t.size`` holds, read piece by piece."""
    shapes = [reader.shape(n) for n in t.hf]
    if t.dim is None:
        parts = [reader.read(n) for n in t.hf]
    else:
        parts = []
        for n, s in zip(t.hf, shapes, strict=True):
            step = s[t.dim] // t.size
            parts.append(reader.read(n, t.dim, t.rank * step, (t.rank + 1) * step))
    if t.kind == "copy":
        return parts[0]
    if t.kind == "fc1":
        return torch.cat(parts, dim=0)  # gate first: Megatron's SwiGLU chunks [gate, up]
    groups = model_cfg.num_query_groups // (t.size if t.dim is not None else 1)
    return _pack_groups(*parts, groups)


def load_hf_weights(model, hf_dir: str | Path, model_cfg) -> HFReadStats:
    """Copy an HF checkpoint into ``model`` in place, reading only this rank's part of it.

    This rank's part: its experts under ep, its stage's layers under pp, its tp/etp shard. Returns the
    reader's byte counts. Raises KeyError naming tensors the checkpoint lacks, ValueError on a shape that
    does not match the model, FileNotFoundError naming a missing file."""
    target = unwrap(model).state_dict()
    plan = read_plan(model, model_cfg)
    with HFReader(hf_dir) as reader, torch.no_grad():
        missing = sorted({n for t in plan for n in t.hf if n not in reader.weight_map})
        if missing:
            raise KeyError(f"HF checkpoint {hf_dir} lacks {len(missing)} tensors the config needs, e.g. {missing[:3]}")
        for t in plan:
            if t.dim == 0 and t.kind == "qkv" and model_cfg.num_query_groups % t.size:
                raise ValueError(
                    f"{t.src}: model.num_query_groups={model_cfg.num_query_groups} does not split into {t.size} tp shards"
                )
            shapes = [reader.shape(n) for n in t.hf]
            full = _full_shape(t.kind, shapes)
            want = _local_shape(t, full)
            tensor = target[t.local]
            if want != tuple(tensor.shape):
                on_rank = f" ({want} on this tp rank)" if want != full else ""
                raise ValueError(f"{t.local}: HF tensor has shape {full}{on_rank}, model expects {tuple(tensor.shape)}")
            tensor.copy_(read_target(reader, t, model_cfg).to(tensor.dtype))
        stats = reader.stats
    params = {n for n, _ in unwrap(model).named_parameters()}
    loaded = {t.local for t in plan}
    if params - loaded:
        raise KeyError(
            f"{len(params - loaded)} model parameters not found in {hf_dir}, e.g. {sorted(params - loaded)[:3]}"
        )
    return stats
