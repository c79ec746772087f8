"""Tensor-parallel shards of the learner's (local-spec, canonical-name) state: which dim each
parameter is split on, gathering every shard into the full tensor, and slicing a full one.

Owns the tp layout of Megatron's GPT parameters for HF export / weight sync and HF import:

* column-parallel (split on dim 0): ``linear_qkv`` weight and bias (whole query groups per rank), the word
  embeddings and ``output_layer`` (vocabulary rows);
* column-parallel SwiGLU ``linear_fc1``: each rank holds ``[gate_r; up_r]``, so the full
  tensor is ``[gate_0..gate_{tp-1}; up_0..up_{tp-1}]``, not the rank shards stacked;
* row-parallel (split on dim 1): ``linear_proj``, ``linear_fc2``;
* everything else (norms, q/k norms, router, expert bias) is replicated.

Expert weights (``.mlp.experts.``) are split over the expert-tensor-parallel group (``etp``),
the rest over the tensor-parallel group. tp > 1 MoE cannot be built on CPU (it needs TE's
sequence-parallel norms), so this is tested on hand-sharded state dicts over gloo and has not
yet run end to end in a tp > 1 training job (docs/configs.md).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["gather_tp_shards", "merge_tp_shards", "tp_slice", "tp_split_dim"]

_COLUMN = (".linear_qkv.weight", ".linear_qkv.bias", "embedding.word_embeddings.weight", "output_layer.weight")
_ROW = (".linear_proj.weight", ".linear_fc2.weight")
_SWIGLU = ".linear_fc1.weight"


def tp_split_dim(name: str) -> tuple[int | None, bool]:
    """``(dim, swiglu)`` of a canonical parameter name: dim None = replicated."""
    if name.endswith(_SWIGLU):
        return 0, True
    if name.endswith(_COLUMN):
        return 0, False
    if name.endswith(_ROW):
        return 1, False
    return None, False


def merge_tp_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor ``name`` from its tp/etp shards in rank order."""
    dim, swiglu = tp_split_dim(name)
    if swiglu:
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(shards, dim=dim)


def gather_tp_shards(local: Mapping[str, torch.Tensor], tp_group=None, etp_group=None) -> dict[str, torch.Tensor]:
    """This rank's shards ``{canonical name: tensor}`` -> full tensors (same device), identical on every rank.

    Collective: every rank of ``tp_group`` (and of ``etp_group``, for expert weights) calls it with
    the same names. A group of None or size 1 leaves its tensors as they are.
    """

    def size(group) -> int:
        return 1 if group is None else dist.get_world_size(group)

    out: dict[str, torch.Tensor] = {}
    for name in sorted(local):
        t = local[name]
        group = etp_group if ".mlp.experts." in name else tp_group
        if tp_split_dim(name)[0] is None or size(group) == 1:
            out[name] = t.detach()
            continue
        shards = [torch.empty_like(t) for _ in range(size(group))]
        dist.all_gather(shards, t.detach().contiguous(), group=group)
        out[name] = merge_tp_shards(name, shards)
    return out


def tp_slice(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard (of ``size``) of the full tensor ``full`` named ``name`` (for HF import)."""
    dim, swiglu = tp_split_dim(name)
    if dim is None or size == 1:
        return full
    if full.shape[dim] % (2 * size if swiglu else size):
        raise ValueError(f"{name}: dim {dim} of shape {tuple(full.shape)} does not split into {size} tp shards")
    if swiglu:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]
