"""Fixed-order primitives of the true-on-policy kernels (``moe_rl.exact.kernels``): GEMM tiles, elementwise
blocks and blocked attention whose result for a row never depends on the other rows.

Owns ``_serial`` (torch and MKL on one thread for a call), ``_blocked`` (an elementwise op with every element on
torch's vector path), ``_tiled_bmm`` / ``_tile_gemm`` (matmuls made only of ``[ROW_TILE, K] @ [K, N]`` GEMMs)
and ``_attend`` (softmax attention over fixed key blocks with exact-zero weights for hidden keys). Measured
row-invariant on torch 2.13 CPU (MKL 2024.2) over row counts, row positions and 1-3 threads, fp32 and bf16
inputs (``tests/exact/test_fixed_order.py``): measured, not promised by MKL's documentation. Pure torch, no
moe_rl imports: the SGLang server process imports it.
"""

from __future__ import annotations

import contextlib

import torch

BLOCK = 8192  # elements per elementwise call: < torch's GRAIN_SIZE (32768), multiple of 64
ROW_TILE = 16  # rows per GEMM tile: every matmul the kernels make has this M (rows padded with zeros)
KEY_BLOCK = 64  # keys per attention block: scores and P @ V are computed one block of keys at a time


@contextlib.contextmanager
def _serial():
    """Torch (and MKL) on one thread for the enclosed ops, restored after. With more threads MKL may split a
    GEMM's reduction between them, and an elementwise op's per-thread chunks get scalar tails mid-tensor; on
    one thread neither depends on the caller's thread count (server and learner may differ)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _blocked(fn, x: torch.Tensor, pad_value: float = 1.0) -> torch.Tensor:
    """``fn`` applied elementwise with every element on torch's vector path (see module doc): one call, on
    one thread, over the elements padded to whole blocks of ``BLOCK``, so no element falls in a scalar tail."""
    flat = x.contiguous().reshape(-1)
    n = flat.numel()
    pad = (-n) % BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_full((pad,), pad_value)])
    if not n:
        return flat.view(x.shape)
    with _serial():
        out = fn(flat)
    return out[:n].view(x.shape)


def _tiled_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a[G, M, K] @ b[G, K, N]`` (fp32) with every GEMM of the fixed shape ``[ROW_TILE, K] @ [K, N]``: the
    rows are padded to whole tiles of ``ROW_TILE`` and the tiles batched, on one thread. A row's result then
    depends only on that row, ``K``, ``N`` and ``b`` -- not on ``M`` or on where the row sits (BLAS picks its
    kernel and blocking by the GEMM's shape and thread count, which are now fixed). Callers pass ``b`` in one
    layout per use (its strides choose the BLAS variant too)."""
    G, M, K = a.shape
    N = b.shape[-1]
    pad = (-M) % ROW_TILE
    a = torch.cat([a, a.new_zeros(G, pad, K)], dim=1) if pad else a.contiguous()
    nt = (M + pad) // ROW_TILE
    tiles = a.view(G * nt, ROW_TILE, K)
    bb = b.expand(nt, K, N) if G == 1 else b[:, None].expand(G, nt, K, N).reshape(G * nt, K, N)
    return _tile_gemm(tiles, bb).view(G, nt * ROW_TILE, N)[:, :M]


def _tile_gemm(tiles: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``tiles[T, ROW_TILE, K] @ b[T, K, N]`` (one GEMM per tile, on one thread) -> ``[T, ROW_TILE, N]``."""
    with _serial():
        return torch.bmm(tiles, b)


def _attend(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, last_key: torch.Tensor) -> torch.Tensor:
    """Softmax attention of fp32 ``qf[G, M, d]`` over ``kf, vf [G, L, d]``, row ``(g, m)`` seeing keys
    ``0 .. last_key[g, m]`` (``last_key [G, M]``, broadcastable); ``[G, M, d]`` fp32.

    The keys in blocks of ``KEY_BLOCK`` (the last one zero-padded): per block, the scores with ``_tiled_bmm``
    (reduction over ``d``), the keys a row may not see set to ``-inf``; the row max over all blocks (exact
    in any order); ``exp(s - max)`` (``_blocked``); then per block ``p @ [v | 1]`` with ``_tiled_bmm``
    (reduction over the block's keys), the blocks' partial sums added in ascending order, and the weighted
    sum divided by the sum of weights (the last column) at the end. A key a row cannot see has weight
    exactly 0, so the blocks past its own add exact zeros: a row's result depends only on its own keys."""
    G, _, d = qf.shape
    L = kf.shape[1]
    Lp = -(-L // KEY_BLOCK) * KEY_BLOCK
    vf = torch.cat([vf, vf.new_ones(G, L, 1)], dim=-1)  # [G, L, d + 1]
    if Lp > L:
        kf = torch.cat([kf, kf.new_zeros(G, Lp - L, d)], dim=1)
        vf = torch.cat([vf, vf.new_zeros(G, Lp - L, d + 1)], dim=1)
    blocks = range(0, Lp, KEY_BLOCK)
    # every GEMM operand in one layout (``[K, N]`` contiguous), whatever G
    s = torch.cat([_tiled_bmm(qf, kf[:, j : j + KEY_BLOCK].transpose(1, 2).contiguous()) for j in blocks], dim=-1)
    hidden = torch.arange(Lp, device=qf.device) > last_key[..., None]
    s = (s * d**-0.5).masked_fill(hidden, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()  # the shift cancels in the ratio; exact in any order
    p = _blocked(torch.exp, s - m, pad_value=0.0)
    acc = None
    for j in blocks:
        part = _tiled_bmm(p[:, :, j : j + KEY_BLOCK], vf[:, j : j + KEY_BLOCK].contiguous())
        acc = part if acc is None else acc + part
    return acc[..., :d] / acc[..., d:]
