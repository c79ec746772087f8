"""Loads read only what overlaps (issue 52 item 3): ``ShardedDir.part`` on resharded hand-made layouts.

A job of ``tp x dp`` "ranks" writes its rank files as the learner does (each tp shard whole, or cut into
uneven distributed-optimizer flat shards so a cut falls inside a SwiGLU box; experts by ep rank); every rank
of another layout then reads its part in a fresh ``ShardedDir``. Each part must equal the same slice of
the global tensor (built here with ``arange``, as today's full-assemble-then-slice gives it), bit for bit,
and the reader's own counter must show it read its own share plus at most one chunk overlap (it reads
exactly its share), while the full assembly reads every global tensor whole and fails that bound.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe_rl.learner.global_state import GlobalStateError, Slot, _slot_part
from moe_rl.learner.ownership import tensor_slice
from moe_rl.learner.partial_read import check_partition, flat_boxes
from moe_rl.learner.sharded_state import SHARD_FORMAT, ShardedDir, rank_file, write_rank_file, write_safetensors
from moe_rl.learner.tp_shards import tp_slice

EXPERTS = 4
FULL = {
    "decoder.layers.0.mlp.linear_fc1.weight": torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6),  # SwiGLU
    "decoder.layers.0.self_attention.linear_proj.weight": torch.arange(6 * 8, dtype=torch.bfloat16).reshape(6, 8),
    "decoder.layers.0.self_attention.linear_qkv.weight": torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6),
    "decoder.layers.0.input_layernorm.weight": torch.arange(6, dtype=torch.float32) + 0.5,  # replicated over tp
    "decoder.layers.0.self_attention.core_attention.k": torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5),
    "decoder.layers.0.mlp.router.scale": torch.tensor(3.5),  # 0-d
    **{
        f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2.weight": torch.arange(24, dtype=torch.float32)
        .reshape(6, 4)
        .add(100 * e)
        for e in range(EXPERTS)
    },
}


def _experts(name: str, rank: int, ep: int) -> bool:
    """Whether ep rank ``rank`` (of ``ep``) holds ``name`` (every rank holds the non-expert tensors)."""
    if ".local_experts." not in name:
        return True
    e = int(name.split(".local_experts.")[1].split(".")[0])
    return e // (EXPERTS // ep) == rank


def _flat(n: int, d: int, dp: int) -> tuple[int, int]:
    """Data-parallel rank ``d``'s flat range of ``n`` elements: uneven (one fewer for rank 0), as cuts may fall."""
    cuts = [0] + [min(n, max(0, k * n // dp - (1 if k < dp else 0))) for k in range(1, dp)] + [n]
    return cuts[d], cuts[d + 1]


def _layout(tp: int, dp: int, ep: int = 1, distopt: bool = True):
    """Per rank (t, d): ``(name, TensorSlice, flat range | None)`` of every tensor it holds (experts: ep = dp ranks)."""
    for t in range(tp):
        for d in range(dp):
            parts = []
            for name, full in FULL.items():
                if not _experts(name, d % ep, ep):
                    continue
                local = tp_slice(name, full, t, tp)
                s = tensor_slice(name, name, tuple(local.shape), t, tp)
                edp = dp // ep if ".local_experts." in name else dp
                flat = _flat(local.numel(), d // ep if ".local_experts." in name else d, edp) if distopt else None
                parts.append((name, s, local, flat, edp))
            yield t, d, parts


def _write(directory, tp: int, dp: int, ep: int = 1, distopt: bool = True) -> None:
    """The job writes as ``sharded_state`` would: flat shards (tp rank 0 only for a tp-replicated tensor) or each
    tensor by one replica."""
    directory.mkdir(parents=True, exist_ok=True)
    for t, d, parts in _layout(tp, dp, ep, distopt):
        entries = []
        for name, s, local, flat, edp in parts:
            if not s.split and t != 0:
                continue
            if flat is not None:
                entries.append((f"exp_avg/{name}", s, local.reshape(-1)[flat[0] : flat[1]].clone(), flat))
            elif (d // ep if ".local_experts." in name else d) == sorted(FULL).index(name) % edp:
                entries.append((f"exp_avg/{name}", s, local, None))
        write_rank_file(directory, "optimizer", t * dp + d, tp * dp, entries)


def _read_as(directory, tp: int, dp: int, ep: int = 1, distopt: bool = True, full_then_slice: bool = False):
    """Every rank of the loading layout reads its parts in its own ``ShardedDir``: ``[(bytes read, own bytes,
    largest chunk, got, want)]`` per rank."""
    out = []
    for t, d, parts in _layout(tp, dp, ep, distopt):
        src = ShardedDir(directory, "optimizer")
        own, got, want = 0, [], []
        for name, s, local, flat, _ in parts:
            ref = local.reshape(-1)[flat[0] : flat[1]] if flat else local
            if full_then_slice:  # the previous reader: assemble the global tensor, then slice it
                part = tp_slice(name, src.full(f"exp_avg/{name}"), t, tp)
                part = part.reshape(-1)[flat[0] : flat[1]] if flat else part
            else:
                part = src.part(f"exp_avg/{name}", s, flat)
            got.append(part)
            want.append(ref)
            own += ref.numel() * ref.element_size()
        chunk = 4 * max(math.prod(fh.get_slice(c["key"]).get_shape()) for cs in src.chunks.values() for fh, c in cs)
        out.append((src.bytes_read, own, chunk, got, want))
    return out


LAYOUTS = {  # (saved tp, dp, ep, distributed optimizer) -> (loaded ...)
    "2 ranks -> 1": ((1, 2, 1, True), (1, 1, 1, True)),
    "1 rank -> 2": ((1, 1, 1, True), (1, 2, 1, True)),
    "ep 2 -> ep 1, dp 2": ((1, 2, 2, True), (1, 2, 1, True)),
    "ep 1 -> ep 2": ((1, 2, 1, True), (1, 2, 2, True)),
    "tp 2 x dp 2 -> tp 1 x dp 3": ((2, 2, 1, True), (1, 3, 1, True)),
    "tp 1 x dp 3 -> tp 2 x dp 2": ((1, 3, 1, True), (2, 2, 1, True)),
    "plain optimizer tp 2 -> distributed dp 2": ((2, 1, 1, False), (1, 2, 1, True)),
    "distributed dp 2 -> plain tp 2": ((1, 2, 1, True), (2, 1, 1, False)),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_each_rank_reads_its_part_bitwise_and_only_its_share(case, tmp_path, device):
    saved, loaded = LAYOUTS[case]
    _write(tmp_path, *saved)
    for read, own, _, got, want in _read_as(tmp_path, *loaded):
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g.to(device), w.to(device)), case
        assert read == own, f"{case}: read {read} bytes for {own} owned"  # exactly its share: no chunk overlap


def test_the_full_assembly_fails_the_bytes_bound(tmp_path):
    """Break test: today's full-assemble-then-slice returns the same parts but reads every global tensor."""
    _write(tmp_path, 1, 2)
    for read, own, chunk, got, want in _read_as(tmp_path, 1, 2, full_then_slice=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert read > own + chunk, (read, own, chunk)


def test_every_saved_byte_is_read_by_some_rank_once_across_a_resharded_load(tmp_path):
    _write(tmp_path, 2, 2)
    total = sum(t.numel() * t.element_size() for t in FULL.values())
    assert sum(r[0] for r in _read_as(tmp_path, 1, 3)) == total


def test_flat_boxes_are_contiguous_and_partition_the_range():
    shape = (3, 4, 5)
    for a, b in ((0, 60), (7, 8), (3, 41), (20, 40), (19, 59), (0, 1), (59, 60)):
        boxes = flat_boxes(shape, a, b)
        assert len(boxes) <= 2 * len(shape) - 1
        idx = torch.arange(60).reshape(shape)
        for off, ext, start in boxes:
            sub = idx[tuple(slice(o, o + e) for o, e in zip(off, ext, strict=True))].reshape(-1)
            assert torch.equal(sub, torch.arange(start, start + math.prod(ext)))  # contiguous, at its flat start
        assert sum(math.prod(e) for _, e, _ in boxes) == b - a and boxes[0][2] == a
        assert check_partition(shape, [(o, e, "x") for o, e, _ in flat_boxes(shape, 0, a) + boxes]) == (
            f"{60 - b} elements missing, 0 written twice" if b < 60 else ""
        )


def test_a_gap_or_an_overlap_is_refused_naming_the_tensor_and_both_files(tmp_path):
    name = "decoder.layers.0.self_attention.core_attention.k"
    key, flat = f"exp_avg/{name}", FULL[name].reshape(-1)
    s = tensor_slice(name, name, tuple(FULL[name].shape), 0, 1)
    write_rank_file(tmp_path, "optimizer", 0, 2, [(key, s, flat[:19].clone(), (0, 19))])
    write_rank_file(tmp_path, "optimizer", 1, 2, [(key, s, flat[20:].clone(), (20, 60))])
    with pytest.raises(GlobalStateError, match=rf"{key} is not covered exactly once .*\(1 elements missing, 0 written"):
        ShardedDir(tmp_path, "optimizer")
    write_rank_file(tmp_path, "optimizer", 1, 2, [(key, s, flat[18:].clone(), (18, 60))])
    with pytest.raises(
        GlobalStateError,
        match=rf"{key} .*0 elements missing, 1 written twice; optimizer-r00000.safetensors:{key}@0 and "
        rf"optimizer-r00001.safetensors:{key}@0 overlap",
    ):
        ShardedDir(tmp_path, "optimizer")


def test_a_chunk_index_that_does_not_fit_its_stored_tensor_is_refused_naming_the_file(tmp_path):
    name = "decoder.layers.0.self_attention.core_attention.k"
    key = f"exp_avg/{name}"
    index = [{"key": f"{key}@0", "name": key, "shape": [3, 4, 5], "offsets": [0, 0, 0], "box": [3, 4, 5], "flat": None}]
    meta = {"format": SHARD_FORMAT, "kind": "optimizer", "rank": "0", "world_size": "1", "chunks": json.dumps(index)}
    write_safetensors(rank_file(tmp_path, "optimizer", 0), [(f"{key}@0", torch.zeros(3, 4, 4))], meta)
    src = ShardedDir(tmp_path, "optimizer")  # the index alone covers the tensor
    with pytest.raises(GlobalStateError, match=r"optimizer-r00000.safetensors: chunk .*k@0 of .* holds \(3, 4, 4\)"):
        src.full(key)


def test_the_optimizer_load_passes_its_flat_range_to_the_reader(megatron_world, tmp_path, device):
    """The loader's own path (``global_state._slot_part``, as ``load_optimizer`` calls it) on a dp=2 save read
    as the other half of a distributed optimizer's shards: it reads that half's bytes, not the whole tensor."""
    _write(tmp_path, 1, 2)
    src = ShardedDir(tmp_path, "optimizer")
    own = 0
    for name, full in FULL.items():
        flat = _flat(full.numel(), 1, 2)
        slot = Slot(full.clone(), full.reshape(-1)[flat[0] : flat[1]], None, flat)
        got = _slot_part(src, f"exp_avg/{name}", name, slot)
        assert torch.equal(got.to(device), full.reshape(-1)[flat[0] : flat[1]].to(device)), name
        own += got.numel() * got.element_size()
    assert src.bytes_read == own


def test_chunks_of_overlapping_boxes_are_refused(tmp_path):
    """The cover check across boxes (not only flat ranges of one box): a tp=1 copy and a tp=2 shard of one tensor."""
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    key, full = f"exp_avg/{name}", FULL[name]
    write_rank_file(tmp_path, "optimizer", 0, 2, [(key, tensor_slice(name, name, tuple(full.shape), 0, 1), full, None)])
    shard = tp_slice(name, full, 1, 2)
    write_rank_file(
        tmp_path, "optimizer", 1, 2, [(key, tensor_slice(name, name, tuple(shard.shape), 1, 2), shard, None)]
    )
    with pytest.raises(
        GlobalStateError, match=rf"{key} .*0 elements missing, 24 written twice; .*r00000.* and .*overlap"
    ):
        ShardedDir(tmp_path, "optimizer")
