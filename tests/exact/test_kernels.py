"""The shared kernels of ``rollout.true_on_policy``: a row's result never depends on its batch.

Each kernel is compared bit for bit between one call over many rows and one call per row (the
server's decode computes one row at a time, the learner a whole padded batch), and attention between
a whole-sequence prefill, token-by-token decode and a chunked prefill. Where torch's stock op is not
row-invariant (fp32 ``F.linear``) that is asserted too, so the test shows what the kernel fixes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from moe_rl.exact import kernels as K
from moe_rl.replay.keep_mask import KeptSets, keep_mask_logprobs, kept_mask

DTYPES = [torch.float32, torch.bfloat16]


def _rows(fn, x):
    return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_is_row_invariant(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 64, generator=g).to(dtype), torch.randn(96, 64, generator=g).to(dtype)
    assert torch.equal(K.linear(x, w), _rows(lambda r: K.linear(r, w), x))
    assert K.linear(x, w, out_dtype=torch.float32).dtype == torch.float32


def test_stock_fp32_matmul_is_not_row_invariant():
    """Why the kernel exists: BLAS picks its reduction by M (the fp32 CPU case docs/sglang.md notes)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 64, generator=g), torch.randn(96, 64, generator=g)
    assert not torch.equal(F.linear(x, w), _rows(lambda r: F.linear(r, w), x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_norm_rope_and_logprobs_are_row_invariant(dtype):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(41, 128, generator=g).to(dtype)
    assert torch.equal(K.swiglu(h), _rows(K.swiglu, h))
    w = torch.randn(128, generator=g).to(dtype)
    assert torch.equal(K.rms_norm(h, w, 1e-6), _rows(lambda r: K.rms_norm(r, w, 1e-6), h))
    pos = torch.arange(50)
    cos, sin = K.rope_cos_sin(pos, 16, 1e6)
    one = [K.rope_cos_sin(pos[i : i + 1], 16, 1e6) for i in range(50)]
    assert torch.equal(cos, torch.cat([c for c, _ in one])) and torch.equal(sin, torch.cat([s for _, s in one]))
    logits = torch.randn(30, 64, generator=g)
    t = torch.tensor(0.7)
    assert torch.equal(K.token_logprobs(logits, t), _rows(lambda r: K.token_logprobs(r, t), logits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_prefill_equals_decode_and_chunked_prefill(dtype):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(20, h, 16, generator=g).to(dtype) for h in (4, 2, 2))
    prefill = K.attention(q, k, v, start=0)
    decode = torch.cat([K.attention(q[i : i + 1], k[: i + 1], v[: i + 1], start=i) for i in range(20)])
    chunked = torch.cat([K.attention(q[:7], k[:7], v[:7], start=0), K.attention(q[7:], k, v, start=7)])
    assert torch.equal(prefill, decode) and torch.equal(prefill, chunked)


@pytest.mark.parametrize("topk", [2, 8])
def test_router_and_experts_are_row_invariant(topk):
    g = torch.Generator().manual_seed(3)
    E, H, FFN = 16, 64, 32
    x = torch.randn(30, H, generator=g)
    weights, ids = K.router_topk(K.router_logits(x, torch.randn(E, H, generator=g)), topk)
    w13, w2 = torch.randn(E, 2 * FFN, H, generator=g) * 0.1, torch.randn(E, H, FFN, generator=g) * 0.1
    out = K.moe_experts(x, weights, ids, w13, w2)
    assert torch.equal(
        out, torch.cat([K.moe_experts(x[i : i + 1], weights[i : i + 1], ids[i : i + 1], w13, w2) for i in range(30)])
    )
    # a plain float reference (order-free up to rounding): the kernel computes the MoE it claims to
    ref = torch.zeros_like(x, dtype=torch.float64)
    for j in range(topk):
        for r in range(30):
            e = int(ids[r, j])
            h = x[r].double() @ w13[e].double().T
            a = F.silu(h[:FFN]) * h[FFN:] * float(weights[r, j])
            ref[r] += a @ w2[e].double().T
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(weights.sum(-1), torch.ones(30))


def test_blocked_matches_stock_up_to_ulps_and_linear_has_gradients():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 64, generator=g, requires_grad=True)
    w = torch.randn(8, 64, generator=g, requires_grad=True)
    K.linear(x, w).sum().backward()
    assert torch.allclose(x.grad, w.detach().sum(0).expand(5, 64)) and torch.allclose(
        w.grad, x.detach().sum(0).expand(8, 64)
    )
    assert torch.allclose(K.silu(x.detach()), F.silu(x.detach()), rtol=1e-6, atol=1e-7)


def test_bf16_top8_combine_equals_megatron_unpermute():
    """The combine against Megatron-Core's own ``permute``/``unpermute`` (the learner's dispatcher path): in bf16
    with top-8, torch's CPU ``scatter_add_`` accumulates in fp32 and rounds once, so a bf16 running sum would
    differ (cpu_midsize in bf16 flipped 2.5% of prompt routes that way before the kernel accumulated in fp32)."""

    g = torch.Generator().manual_seed(5)
    E, H, FFN, M, k = 16, 64, 32, 40, 8
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * FFN, H, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(E, H, FFN, generator=g) * 0.1).to(torch.bfloat16)
    weights, ids = K.router_topk(K.router_logits(x, torch.randn(E, H, generator=g)), k)
    routing_map = torch.zeros(M, E, dtype=torch.bool).scatter_(1, ids, True)
    probs = torch.zeros(M, E).scatter_(1, ids, weights)
    permuted, _, sorted_indices = permute(x, routing_map)  # rows grouped by expert, ascending
    counts = routing_map.sum(0).tolist()
    rows, start = [], 0
    for e, n in enumerate(counts):
        t = sorted_indices[start : start + n]
        a = (K.swiglu(K.linear(permuted[start : start + n], w13[e])) * probs[t, e, None]).to(torch.bfloat16)
        rows.append(K.linear(a, w2[e]))
        start += n
    megatron = unpermute(torch.cat(rows), sorted_indices, restore_shape=x.shape)
    assert torch.equal(K.moe_experts(x, weights, ids, w13, w2), megatron)


def test_kept_set_logprobs_are_row_invariant_and_renormalise_over_the_kept_set(device):
    """Keep Sampling Mask's kernel: a batch (the learner, a number for the temperature) equals one row at a time
    (the server's decode, a ``[1, 1]`` temperature tensor) bit for bit; it is the renormalised log-prob (float64
    reference, and ``keep_mask_logprobs`` to an ulp or so); the target joins its kept set; an empty kept set is
    the whole vocabulary, exactly ``token_logprobs``; the gradient reaches the kept ids only."""
    g = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(23, 96, generator=g)).to(device)
    sets = [torch.topk(logits[i], 1 + i % 20).indices.tolist() for i in range(23)]
    targets = torch.tensor([s[i % len(s)] for i, s in enumerate(sets)], device=device)
    targets[5] = int(torch.argmin(logits[5]))  # outside its set: kept anyway
    sets[7] = []  # no truncation
    kept = KeptSets.from_lists(sets, device=device)
    mask = kept_mask(kept, 96)
    assert mask.device == logits.device and mask[7].all() and int(mask[3].sum()) == 4
    got = K.kept_token_logprobs(logits, mask, targets, 0.7)
    one_t = torch.tensor([[0.7]], device=device)
    rows = [K.kept_token_logprobs(logits[i : i + 1], mask[i : i + 1], targets[i : i + 1], one_t) for i in range(23)]
    assert torch.equal(got, torch.cat(rows))
    assert got[7] == K.token_logprobs(logits[7:8], 0.7)[0, targets[7]]
    z = logits.double().cpu() / 0.7
    for i in range(23):
        ids = sorted(set(sets[i]) | {int(targets[i])}) if sets[i] else list(range(96))
        ref = z[i, targets[i]] - torch.logsumexp(z[i, ids], 0)
        assert abs(float(got[i]) - float(ref)) < 1e-5, i
    stock = keep_mask_logprobs(logits, targets, kept, 0.7).logp
    assert (got - stock).abs().max() < 1e-5
    leaf = logits.clone().requires_grad_(True)
    K.kept_token_logprobs(leaf, mask, targets, 0.7).sum().backward()
    assert torch.isfinite(leaf.grad).all() and not leaf.grad[3][~mask[3]].any() and leaf.grad[3][mask[3]].any()
