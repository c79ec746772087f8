"""Reading a rank's part of a global tensor from saved chunks: only the bytes that overlap it.

Owns the box arithmetic of partial loads (``sharded_state.ShardedDir.part`` reads through it). A saved
chunk is a box of the global tensor (``offsets``, ``box``), stored whole (an N-d tensor of the box's
shape) or as the flat range ``[a, b)`` of the box flattened (a 1-d tensor). A request is this rank's
part: boxes of the global tensor (``ownership.TensorSlice.boxes``), whole or as a flat range of their
concatenation (a distributed-optimizer shard). Both are cut into *runs*, sub-boxes that are contiguous
in their tensor's flat order (``flat_boxes``: at most ``2 * ndim - 1`` per flat range); each pair of a
request run and a chunk run meets in at most one box, read with ``safe_open(...).get_slice`` — the N-d
slice of a whole chunk, or the contiguous 1-d ranges of a flat chunk — and written into place. No
global tensor and no cover map: ``check_cover`` proves from the chunk index alone that the chunks cover a
tensor exactly once (per box, its flat ranges sorted in one pass; the boxes, by ``check_partition``'s sweep
over dim 0), and the elements a request gets are counted.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["Run", "check_cover", "check_partition", "flat_boxes", "intersect", "read_runs"]

Run = tuple[tuple[int, ...], tuple[int, ...], int]
"""``(offsets, shape, flat start)``: a box contiguous in its tensor's flat order, starting at that flat index."""


def flat_boxes(shape: Sequence[int], a: int, b: int) -> list[Run]:
    """Elements ``[a, b)`` of a tensor of ``shape`` flattened, as boxes each contiguous in flat order."""
    shape = tuple(shape)
    if a >= b:
        return []
    if len(shape) <= 1:
        return [((a,), (b - a,), a)] if shape else [((), (), 0)]
    inner = math.prod(shape[1:])
    out: list[Run] = []
    row, col = divmod(a, inner)
    if col:  # a partial first row
        stop = min(b, (row + 1) * inner)
        out += [((row, *o), (1, *s), row * inner + f) for o, s, f in flat_boxes(shape[1:], col, stop - row * inner)]
        a, row = stop, row + 1
    if a < b and (rows := (b - a) // inner):
        out.append(((row, *(0,) * (len(shape) - 1)), (rows, *shape[1:]), a))
        a, row = a + rows * inner, row + rows
    if a < b:  # a partial last row
        out += [((row, *o), (1, *s), row * inner + f) for o, s, f in flat_boxes(shape[1:], 0, b - a)]
    return out


def intersect(o1, s1, o2, s2) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box where boxes ``(o1, s1)`` and ``(o2, s2)`` meet, None when they do not."""
    lo = tuple(max(x, y) for x, y in zip(o1, o2, strict=True))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(o1, s1, o2, s2, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def _contiguous_ranges(rel: Sequence[int], shape: Sequence[int], outer: Sequence[int]) -> list[tuple[int, int]]:
    """Box ``(rel, shape)`` inside a box of shape ``outer``, as ``(flat start, length)`` ranges of ``outer``'s
    flat order (one range when the box spans every dim after its first partial one)."""
    nd = len(outer)
    if nd == 0:
        return [(0, 1)]
    strides = [math.prod(outer[d + 1 :]) for d in range(nd)]
    k = nd - 1
    while k > 0 and shape[k] == outer[k] and rel[k] == 0:
        k -= 1
    length = shape[k] * strides[k]
    base = rel[k] * strides[k]
    heads = itertools.product(*(range(rel[d], rel[d] + shape[d]) for d in range(k)))
    return [(base + sum(i * st for i, st in zip(h, strides, strict=False)), length) for h in heads]


def read_runs(
    request: Sequence[Run],
    chunks: Sequence[tuple[Run, int, Callable]],
    out: torch.Tensor,
) -> int:
    """Fill 1-d ``out`` (request run ``(offsets, shape, s)`` at ``out[s:]``) from ``chunks``: ``(run, stored
    start, read)``, where ``read(slices)`` returns the stored tensor's N-d slice (a whole chunk: ``stored start``
    is -1) or ``read([(start, length), ...])`` the concatenated 1-d ranges (a flat chunk's run, from ``stored
    start``). Returns the number of elements written (each request element at most once when the chunks
    partition the tensor; ``check_partition`` proves that)."""
    got = 0
    for q_off, q_shape, q_start in request:
        q_view = out[q_start : q_start + math.prod(q_shape)].view(q_shape)
        for (p_off, p_shape, _), stored, read in chunks:
            meet = intersect(q_off, q_shape, p_off, p_shape)
            if meet is None:
                continue
            m_off, m_shape = meet
            rel = tuple(m - p for m, p in zip(m_off, p_off, strict=True))
            if stored < 0:
                data = read(tuple(slice(r, r + n) for r, n in zip(rel, m_shape, strict=True)))
            else:
                data = read([(stored + s, n) for s, n in _contiguous_ranges(rel, m_shape, p_shape)])
            place = tuple(slice(m - q, m - q + n) for m, q, n in zip(m_off, q_off, m_shape, strict=True))
            q_view[place] = data.reshape(m_shape)
            got += math.prod(m_shape)
    return got


def check_partition(shape: Sequence[int], boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...], str]]) -> str:
    """'' when ``boxes`` ``(offsets, extent, label)`` cover a tensor of ``shape`` exactly once, else what is
    wrong: ``"<m> elements missing, <t> written twice"`` (and the labels of two overlapping boxes). A box
    outside the tensor counts as written twice. Sweeps dim 0: only boxes whose rows meet are compared."""
    return _problem(*_partition(shape, boxes))


def _partition(shape: Sequence[int], boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...], str]]) -> tuple:
    """``(elements missing, elements written twice, what overlaps)`` of ``check_partition``."""
    shape = tuple(shape)
    total, volume, twice, pair = math.prod(shape), 0, 0, ""
    active: list[tuple[tuple[int, ...], tuple[int, ...], str]] = []
    zero = (0,) * len(shape)
    for off, ext, label in sorted(boxes, key=lambda b: (b[0][:1], b[2])):
        n = math.prod(ext)
        volume += n
        inside = intersect(zero, shape, off, ext) if n else (off, ext)
        if inside is None or math.prod(inside[1]) != n:
            twice, pair = twice + n - (math.prod(inside[1]) if inside else 0), pair or f"{label} lies outside it"
        if shape:
            active = [b for b in active if b[0][0] + b[1][0] > off[0]]
        for o, e, other in active:
            if (meet := intersect(o, e, off, ext)) is not None:
                twice += math.prod(meet[1])
                pair = pair or f"{other} and {label} overlap"
        active.append((off, ext, label))
    return total - (volume - twice), twice, pair


def check_cover(shape: Sequence[int], chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...], int, int, str]]) -> str:
    """``check_partition`` for saved chunks ``(offsets, box, a, b, label)`` (elements ``[a, b)`` of the box
    flattened; a whole chunk is ``[0, numel)``): the chunks of each box must cover ``[0, numel)`` of it exactly
    once (sorted ranges: one pass), and the boxes partition the tensor (``check_partition`` over the few boxes)."""
    groups: dict[tuple, list[tuple[int, int, str]]] = {}
    for off, box, a, b, label in chunks:
        groups.setdefault((tuple(off), tuple(box)), []).append((a, b, label))
    missing = twice = 0
    pair = ""
    for (_, box), ranges in groups.items():
        n, pos, last = math.prod(box), 0, ""
        for a, b, label in sorted(ranges):
            if a < 0 or b > n or a > b:
                twice, pair = twice + max(b - a, 0), pair or f"{label} lies outside its box"
                continue
            missing += max(a - pos, 0)
            if a < pos:
                twice, pair = twice + min(pos, b) - a, pair or f"{last} and {label} overlap"
            pos, last = max(pos, b), label
        missing += n - pos
    m, t, p = _partition(shape, [(off, box, rs[0][2]) for (off, box), rs in groups.items()])
    return _problem(missing + m, twice + t, pair or p)


def _problem(missing: int, twice: int, pair: str) -> str:
    if not missing and not twice:
        return ""
    return f"{missing} elements missing, {twice} written twice" + (f"; {pair}" if pair else "")
