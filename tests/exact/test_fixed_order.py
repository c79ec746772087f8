"""The vectorised exact kernels (``moe_rl.exact.fixed_order``) stay row-invariant: randomized row counts, row
positions, query splits and thread counts give the same bits, in fp32 and bf16.

The kernels are the CPU contract of ``rollout.true_on_policy`` (GPU servers and learners are out of scope,
docs/true_on_policy.md), so the tensors are built on the CPU whatever the ``device`` fixture says.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from moe_rl.exact import kernels as K

DTYPES = [torch.float32, torch.bfloat16]


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_are_invariant_over_counts_positions_and_threads(dtype):
    """Random row counts and offsets, 1 and 2 threads: every slice equals the rows computed one at a time on one
    thread. K = 2048 is where MKL splits a GEMM's reduction between threads (a multi-threaded tile differs)."""
    gen = torch.Generator().manual_seed(10)
    for n_out, k in [(96, 64), (64, 2048)]:
        x = torch.randn(200, k, generator=gen).to(dtype)
        w = torch.randn(n_out, k, generator=gen).to(dtype)
        with _threads(1):
            ref = torch.cat([K.linear(x[i : i + 1], w, torch.float32) for i in range(200)])
        for threads in (1, 2):
            with _threads(threads):
                assert torch.equal(K.linear(x, w, torch.float32), ref), threads
                for i in (0, 77, 199):  # one row: a single GEMM, which MKL would split over threads
                    assert torch.equal(K.linear(x[i : i + 1], w, torch.float32), ref[i : i + 1]), (threads, i)
                for _ in range(4):
                    m = int(torch.randint(1, 120, (1,), generator=gen))
                    off = int(torch.randint(0, 201 - m, (1,), generator=gen))
                    assert torch.equal(K.linear(x[off : off + m], w, torch.float32), ref[off : off + m]), (m, off)
        assert torch.allclose(ref, x.float() @ w.float().T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_prefill_chunks_decode_and_batched_decode_agree(dtype):
    """Over several key blocks (T = 150 > 2 * KEY_BLOCK), with GQA: a whole prefill, random chunked prefills,
    token-by-token decode and one batched decode of ragged sequences (stale NaN past a sequence's end) give
    the same bits, on 1 and 2 threads; and they compute attention (SDPA reference)."""
    gen = torch.Generator().manual_seed(11)
    T, H, Hkv, d = 150, 8, 4, 16
    q, k, v = (torch.randn(T, h, d, generator=gen).to(dtype) for h in (H, Hkv, Hkv))
    with _threads(1):
        full = K.attention(q, k, v, start=0)
    decode = torch.cat([K.attention(q[i : i + 1], k[: i + 1], v[: i + 1], start=i) for i in range(T)])
    assert torch.equal(full, decode)
    for threads in (1, 2):
        with _threads(threads):
            cuts = sorted(torch.randperm(T - 1, generator=gen)[:3].add(1).tolist()) + [T]
            parts, s0 = [], 0
            for s1 in cuts:
                parts.append(K.attention(q[s0:s1], k[:s1], v[:s1], start=s0))
                s0 = s1
            assert torch.equal(torch.cat(parts), full), cuts
            lens = torch.tensor([1, 64, 65, 129, 150, 7])
            ks = k[None].repeat(6, 1, 1, 1)
            vs = v[None].repeat(6, 1, 1, 1)
            ks[0, 1:], vs[2, 65:] = float("nan"), float("nan")  # a cache slot past the sequence is never read
            batched = K.attention_decode(q[lens - 1], ks, vs, lens)
            assert torch.equal(batched, full[lens - 1])
    rep = H // Hkv
    ref = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().repeat_interleave(rep, 1).transpose(0, 1),
        v.float().repeat_interleave(rep, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    assert torch.allclose(full.float(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vectorised_experts_equal_one_linear_per_expert(dtype):
    """All experts' GEMMs in one call equal Megatron's SequentialMLP order (``linear`` per expert, which the
    learner runs) bit for bit, top-8 of 64, and a token's output does not depend on the batch."""
    gen = torch.Generator().manual_seed(12)
    E, H, FFN, M, topk = 64, 128, 32, 90, 8
    x = torch.randn(M, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * FFN, H, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, FFN, generator=gen) * 0.1).to(dtype)
    weights, ids = K.router_topk(K.router_logits(x, torch.randn(E, H, generator=gen)), topk)
    y = torch.zeros(M, topk, H, dtype=dtype)
    for e in torch.unique(ids).tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        a = (K.swiglu(K.linear(x[rows], w13[e])) * weights[rows, slots, None]).to(dtype)
        y[rows, slots] = K.linear(a, w2[e])
    ordered = torch.gather(y, 1, torch.argsort(ids, dim=-1, stable=True)[:, :, None].expand_as(y))
    ref = torch.zeros(M, H)
    for j in range(topk):
        ref = ref + ordered[:, j]
    with _threads(2):
        got = K.moe_experts(x, weights, ids, w13, w2)
        assert torch.equal(got, ref.to(dtype))
        assert torch.equal(K.moe_experts(x[17:20], weights[17:20], ids[17:20], w13, w2), got[17:20])
