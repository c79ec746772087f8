"""Which rank owns which slice of which global tensor: the learner's layout map (no collectives, no I/O).

Owns the mapping from this rank's local tensors (state-dict names of the bare ``GPTModel`` under any
(tp, etp, ep, pp, dp) layout) to the layout-free *global* tensors that checkpoints, the reference
policy and the HF export are written in:

* global names: local-spec names (``canonical_name``: TE-spec names mapped), global layer numbers
  under pp (``globalise_layer``) and global expert ids under ep (expert ``e`` of ep rank ``r`` is
  ``r * num_local + e``);
* the box(es) of the global tensor a local tensor holds (``TensorSlice``): one box for an unsplit or
  plainly tp-split tensor, two for a SwiGLU ``linear_fc1`` (rank r holds ``[gate_r; up_r]``), and
  ``TensorSlice.flat_pieces`` for a flat range of the local tensor (a distributed-optimizer shard);
* which replica writes a replicated tensor (``writes_whole``): the tp/etp rank 0 of a tp-replicated
  tensor, and within the data-parallel replicas (expert-data-parallel for experts) the one the
  byte-balanced assignment picks, so the ranks of a save write about equal shares.

Parallel checkpoints (``sharded_state``) and the streaming weight sync build on it; the tp split
rules themselves are ``tp_shards``'.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_rl.learner.model import unwrap
from moe_rl.learner.tp_shards import tp_split_dim

__all__ = [
    "Box",
    "TensorSlice",
    "canonical_name",
    "expert_slot",
    "global_name",
    "globalise_layer",
    "local_expert_range",
    "local_slices",
    "replica_group",
    "stage_layer_offset",
    "tensor_slice",
    "tp_rank_and_size",
    "writes_whole",
]

_TE_FUSED_NORMS = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),  # dense layers
)
_TE_GROUPED = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERTS = ".mlp.experts.local_experts."


def canonical_name(name: str) -> str:
    """Local-spec name for a parameter of either spec.

    The Transformer Engine spec fuses the pre-attention / dense pre-MLP norms into
    the next linear (``linear_qkv.layer_norm_weight``) and stores grouped-GEMM
    experts as ``experts.linear_fc1.weight<e>``; the local spec has separate norm
    modules and ``experts.local_experts.<e>.linear_fc1.weight``.
    """
    for te, local in _TE_FUSED_NORMS:
        if name.endswith(te):
            return name[: -len(te)] + local
    m = _TE_GROUPED.match(name)
    if m:
        return f"{m.group(1)}.local_experts.{m.group(3)}.{m.group(2)}.weight"
    return name


def expert_slot(name: str) -> tuple[str, int, str] | None:
    """``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight`` -> (prefix, 5, suffix); None: not an expert."""
    if _EXPERTS not in name:
        return None
    prefix, rest = name.split(_EXPERTS, 1)
    idx, suffix = rest.split(".", 1)
    return prefix + _EXPERTS, int(idx), suffix


def local_expert_range(model) -> tuple[int, int]:
    """``(global id of this rank's first expert, experts per ep rank)``."""

    num_local = unwrap(model).config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    return ps.get_expert_model_parallel_rank() * num_local, num_local


def tp_rank_and_size(name: str) -> tuple[int, int]:
    """This rank's (rank, size) in the group that splits ``name``: etp for experts, tp for the rest."""

    if ".mlp.experts." in name:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def stage_layer_offset(model) -> int:
    """Global index of this pipeline stage's first decoder layer (0 without pipeline parallelism)."""
    layers = unwrap(model).decoder.layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def globalise_layer(name: str, offset: int) -> str:
    """``decoder.layers.<local>.…`` of a pipeline stage -> ``decoder.layers.<offset + local>.…``."""
    if not offset:
        return name
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name, count=1)


def global_name(local: str, expert_start: int, layer_offset: int = 0) -> str:
    """Global name of state-dict name ``local`` on a rank whose first expert is ``expert_start``."""
    name = globalise_layer(canonical_name(local), layer_offset)
    slot = expert_slot(name)
    return name if slot is None else f"{slot[0]}{expert_start + slot[1]}.{slot[2]}"


@dataclass(frozen=True)
class Box:
    """Rows ``[row_start, row_stop)`` of the local tensor (all of it for 0-d) are the global box at ``offsets``."""

    row_start: int
    row_stop: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class TensorSlice:
    """Where local tensor ``local_name`` sits in global tensor ``global_name`` of ``global_shape``."""

    local_name: str
    global_name: str
    global_shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    split: bool  # False: the same whole tensor on every rank of its tp/etp group

    def flat_pieces(self, start: int, stop: int) -> list[tuple[Box, int, int, int]]:
        """Flat range ``[start, stop)`` of the flattened local tensor -> ``(box, box_start, box_stop, local_start)``
        per box it meets: elements ``[box_start, box_stop)`` of the flattened box, from local flat ``local_start``."""
        out, base = [], 0
        for box in self.boxes:
            lo, hi = max(start, base), min(stop, base + box.numel)
            if lo < hi:
                out.append((box, lo - base, hi - base, lo))
            base += box.numel
        return out


def tensor_slice(local: str, name: str, shape: tuple[int, ...], rank: int, size: int) -> TensorSlice:
    """Where a local tensor of ``shape`` named ``local`` (global ``name``) on tp/etp rank ``rank`` of ``size`` sits."""
    dim, swiglu = tp_split_dim(name)
    rows = shape[0] if shape else 1
    zero = (0,) * len(shape)
    if dim is None or size == 1:
        return TensorSlice(local, name, shape, (Box(0, rows, zero, shape),), dim is not None)
    full = tuple(s * size if d == dim else s for d, s in enumerate(shape))
    if swiglu:  # local [gate_r; up_r], global [gate_0..gate_{n-1}; up_0..up_{n-1}]
        half = shape[0] // 2
        box = (half, *shape[1:])
        boxes = (
            Box(0, half, (rank * half, *zero[1:]), box),
            Box(half, shape[0], (full[0] // 2 + rank * half, *zero[1:]), box),
        )
        return TensorSlice(local, name, full, boxes, True)
    offsets = tuple(rank * s if d == dim else 0 for d, s in enumerate(shape))
    return TensorSlice(local, name, full, (Box(0, rows, offsets, shape),), True)


def local_slices(model, tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSlice]:
    """``{state-dict name: TensorSlice}`` for ``tensors`` (this rank's, by state-dict name) of ``model``."""
    start, _ = local_expert_range(model)
    offset = stage_layer_offset(model)
    out = {}
    for local, t in tensors.items():
        g = global_name(local, start, offset)
        out[local] = tensor_slice(local, g, tuple(t.shape), *tp_rank_and_size(g))
    return out


def replica_group(name: str):
    """The data-parallel group over which global tensor ``name``'s holders are replicas (expert-dp for experts)."""

    if ".mlp.experts." in name:
        return ps.get_expert_data_parallel_group()
    return ps.get_data_parallel_group(with_context_parallel=True)


def writes_whole(slices: Mapping[str, TensorSlice], nbytes: Mapping[str, int]) -> set[str]:
    """Local names of the tensors this rank writes whole, one writer per global box.

    A tensor replicated over tp/etp is written by tp/etp rank 0; among the data-parallel replicas
    each tensor goes to the replica with the fewest bytes so far (sorted by global name: every
    replica computes the same assignment from the same names and sizes, no communication).
    """

    mine: set[str] = set()
    loads: dict[tuple[int, ...], list[int]] = {}
    for local in sorted(slices, key=lambda n: slices[n].global_name):
        s = slices[local]
        if not s.split and tp_rank_and_size(s.global_name)[0] != 0:
            continue
        group = replica_group(s.global_name) if dist.is_initialized() else None
        size = 1 if group is None else dist.get_world_size(group)
        key = tuple(dist.get_process_group_ranks(group)) if group is not None else (0,)
        load = loads.setdefault(key, [0] * size)
        writer = min(range(size), key=lambda r: (load[r], r))
        load[writer] += nbytes[local]
        if group is None or writer == dist.get_rank(group):
            mine.add(local)
    return mine
