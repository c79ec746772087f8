"""The shared CPU kernels of the true-on-policy mode (``rollout.true_on_policy``).

Owns every op whose rounding decides a token's log-prob or a router decision, written so that a
row's result depends only on that row (never on how many rows are computed with it, on the padded
length, or on whether the row is a prefill or a decode step). The patched SGLang CPU path
(``moe_rl.exact.sglang_hooks``) and the Megatron-Core learner (``moe_rl.learner.exact_spec``) both
call these functions, so both sides round identically. Pure torch (the fixed-order primitives are in
``moe_rl.exact.fixed_order``), no other moe_rl imports: the SGLang server process imports this module.

How each op is made row-invariant (torch 2.13 CPU):

* matmul (``linear``, the experts of ``moe_experts``): BLAS GEMMs of one fixed shape only, on one
  thread (``fixed_order._tiled_bmm``): the rows padded to whole tiles of ``ROW_TILE`` rows, one GEMM
  ``[ROW_TILE, K] @ [K, N]`` per tile, batched. BLAS picks its kernel and blocking by the GEMM's shape and
  thread count (fp32 ``F.linear`` of 37 rows != 37 single rows); both are now fixed, so a row's result
  depends only on that row.
* transcendental elementwise ops (``silu``, ``cos``/``sin``, ``pow``, ``exp``): torch's vectorised loop uses
  SLEEF for whole vectors and the scalar libm function for a tail, which can differ by one ulp, and
  the tail depends on the tensor's size and on the thread split. ``_blocked`` pads to whole blocks of
  ``BLOCK`` elements and runs on one thread, so every element takes the vector path.
* attention (``attention``, ``attention_decode``): all queries at once over the keys in fixed blocks of
  ``KEY_BLOCK`` (``fixed_order._attend``): scores and ``p @ [v | 1]`` per block through the tiled GEMM,
  the blocks' partial sums added in ascending order, every key a query may not see at weight exactly 0
  (the blocks past its own add exact zeros), so prefill, chunked prefill and decode agree.
* routing (``router_logits``/``router_topk``): fp32 logits through ``linear``, ``torch.topk`` on the
  logits then ``softmax`` over the k selected (Megatron's ``pre_softmax=False`` order). ``router_route``
  covers every router Megatron-Core builds: softmax before top-k (``pre_softmax``, no renormalisation),
  and the DeepSeek-V3 layout (sigmoid scores on the vector path, a score-correction bias added for the
  choice only, group-limited top-k, the k sigmoid weights normalised by their sum and scaled by
  ``moe_router_topk_scaling_factor``); every sum of a few values is an explicit chain of adds in a fixed
  order (group scores: in descending order; the normalising sum: in ascending expert id, so a replayed
  route in another slot order gives the same weights).
* biased projections (``linear_bias``, q/k/v bias): the fp32 accumulation of ``linear`` plus the bias in
  fp32, rounded once.
* expert combine (``moe_experts``): the routing weight scales the activation inside each expert
  (Megatron 0.16's ``per_token_scale``), and each token's expert outputs are added to zero in ascending
  expert id, the order of Megatron's unpermute (``scatter_add_`` over expert-sorted rows), in fp32 with
  one rounding at the end: torch's CPU ``scatter_add_``/``index_add_`` accumulate bf16 in fp32.
* RMSNorm, rotary (rotate-half) and the log-softmax with temperature (``token_logprobs``):
  fixed formulas on top of the above; ``token_logprobs`` is SGLang's deterministic-sampler
  ``log_softmax(logits / t)``.
* Keep Sampling Mask's renormalisation over the kept set (``kept_token_logprobs``): the same row-wise
  ``log_softmax`` over the whole vocabulary row with every id outside the kept set at ``-inf``, so the
  reduction length is the vocabulary's whatever the set's size (``exp(-inf)`` adds an exact zero). The
  server's sampler (``sglang_hooks``) and the learner's KSM log-prob (``moe_rl.train.logprob``) both call it.

Backward passes use ordinary kernels (gradients need not be bitwise; only forwards are compared).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_rl.exact.fixed_order import BLOCK, ROW_TILE, _attend, _blocked, _tile_gemm, _tiled_bmm

__all__ = [
    "BLOCK",
    "add_rms_norm",
    "apply_rope",
    "attention",
    "attention_decode",
    "combine_partials",
    "kept_token_logprobs",
    "linear",
    "linear_bias",
    "moe_experts",
    "rms_norm",
    "rope_cos_sin",
    "router_logits",
    "router_route",
    "router_topk",
    "silu",
    "swiglu",
    "token_logprobs",
]


def _rowwise_matmul(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x2[M, K] @ w[N, K].T`` in fp32 (or the inputs' dtype when wider), each row alone (``_tiled_bmm``)."""
    M = x2.shape[0]
    N = w.shape[0]
    acc = torch.promote_types(torch.promote_types(x2.dtype, w.dtype), torch.float32)
    if M == 0:
        return x2.new_zeros((0, N), dtype=acc)
    xa, wa = x2.to(acc), w.to(acc).contiguous()  # the weight as [N, K]: one BLAS layout everywhere
    return _tiled_bmm(xa[None], wa.t()[None])[0]


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, out_dtype):
        ctx.save_for_backward(x, w)
        shp = x.shape
        y = _rowwise_matmul(x.reshape(-1, shp[-1]), w)
        return y.to(out_dtype).view(*shp[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = (g2.to(w.dtype) @ w).view(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = (g2.t().to(x.dtype) @ x.reshape(-1, x.shape[-1])).to(w.dtype)
        return gx, gw, None


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None, tp_blocks: int = 1) -> torch.Tensor:
    """``x[..., K] @ w[N, K].T`` -> ``[..., N]``, row-invariant; accumulated in fp32, cast to ``out_dtype``
    (default ``x.dtype``). ``tp_blocks > 1`` (TBIK): ``K`` split into that many equal blocks, each block's
    product through the tiled GEMM in fp32, the partials combined by ``combine_partials`` -- what a row-parallel
    linear over ``tp_blocks`` tensor-parallel ranks computes, each rank holding one block."""
    K = x.shape[-1]
    if K != w.shape[-1]:
        raise ValueError(f"linear: x has K={K}, weight has K={w.shape[-1]}")
    if tp_blocks == 1:
        return _Linear.apply(x, w, out_dtype or x.dtype)
    if tp_blocks < 1 or K % tp_blocks:
        raise ValueError(f"linear: K={K} does not split into tp_blocks={tp_blocks} equal blocks")
    b = K // tp_blocks
    parts = [
        _Linear.apply(x[..., j * b : (j + 1) * b], w[:, j * b : (j + 1) * b], torch.float32) for j in range(tp_blocks)
    ]
    return combine_partials(parts, out_dtype or x.dtype)


def combine_partials(parts: list[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """The fp32 partial products of a K-split linear, added in ascending block (tensor-parallel rank) order,
    rounded once to ``out_dtype``: the fixed-order reduction of a row-parallel linear."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(out_dtype)


def linear_bias(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``linear`` plus ``bias[N]``, added to the fp32 accumulation and rounded once to ``out_dtype``."""
    if bias is None:
        return linear(x, w, out_dtype)
    return (linear(x, w, torch.float32) + bias.float()).to(out_dtype or x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu`` with every element on the vector path."""
    return _blocked(F.silu, x, pad_value=0.0)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``h = [gate | up]`` along the last dim (Qwen3 / Megatron fc1 layout)."""
    gate, up = torch.chunk(h, 2, dim=-1)
    return silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3 RMSNorm: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, statistics in fp32."""
    xf = x.float()
    var = (xf * xf).sum(-1, keepdim=True) / xf.shape[-1]
    y = xf * _blocked(torch.rsqrt, var + eps)
    return weight * y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(rms_norm(x + residual), x + residual)``: the residual stream added in its own dtype (Megatron's)."""
    s = residual + x
    return rms_norm(s, weight, eps), s


def rope_cos_sin(positions: torch.Tensor, rot_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, rot_dim/2]`` (fp32) of integer ``positions[T]`` for rotate-half RoPE."""
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim
    inv_freq = 1.0 / _blocked(lambda e: torch.pow(float(base), e), exponents)
    angles = positions.to(torch.float32).reshape(-1, 1) * inv_freq.reshape(1, -1)
    return _blocked(torch.cos, angles), _blocked(torch.sin, angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x[T, H, d]`` with ``cos, sin [T, d/2]`` (computed in fp32, cast back)."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    return out.to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries ``q[n, H, d]`` at positions ``start .. start+n-1`` over
    ``k, v [L, Hkv, d]`` (positions ``0 .. L-1``, ``L >= start + n``): query i sees keys
    ``0 .. start+i``. GQA by head groups; scale ``d ** -0.5``; fp32 inside; output ``[n, H, d]``.
    All queries in one pass (``_attend``): prefill, chunked prefill and decode give the same bits."""
    n, H, d = q.shape
    Hkv = k.shape[1]
    if H % Hkv:
        raise ValueError(f"attention: {H} query heads are not a multiple of {Hkv} key/value heads")
    g = H // Hkv
    if n == 0:
        return q.new_zeros((0, H, d))
    L = start + n
    kf = k[:L].float().permute(1, 0, 2)  # [Hkv, L, d]
    vf = v[:L].float().permute(1, 0, 2)
    qf = q.float().reshape(n, Hkv, g, d).permute(1, 0, 2, 3).reshape(Hkv, n * g, d)  # rows: query, then group
    last_key = (start + torch.arange(n, device=q.device)).repeat_interleave(g)[None]  # [1, n * g]
    out = _attend(qf, kf, vf, last_key)  # [Hkv, n * g, d]
    return out.reshape(Hkv, n, g, d).permute(1, 0, 2, 3).reshape(n, H, d).to(q.dtype)


def attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """One decode step of ``R`` sequences at once: query ``q[R, H, d]`` of sequence r (at position
    ``lens[r] - 1``) over its keys ``k, v [R, Lmax, Hkv, d]`` (positions ``0 .. lens[r] - 1``; the rest of the
    row is ignored). Equal bit for bit to ``attention(q[r:r+1], k[r], v[r], start=lens[r] - 1)``."""
    R, H, d = q.shape
    Lmax, Hkv = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"attention_decode: {H} query heads are not a multiple of {Hkv} key/value heads")
    g = H // Hkv
    if R == 0:
        return q.new_zeros((0, H, d))
    lens = lens.to(device=q.device, dtype=torch.long)
    valid = (torch.arange(Lmax, device=q.device)[None, :] < lens[:, None])[:, :, None, None]
    kf = torch.where(valid, k.float(), 0.0).permute(0, 2, 1, 3).reshape(R * Hkv, Lmax, d)  # no stale value
    vf = torch.where(valid, v.float(), 0.0).permute(0, 2, 1, 3).reshape(R * Hkv, Lmax, d)
    qf = q.float().reshape(R * Hkv, g, d)
    last_key = (lens - 1).repeat_interleave(Hkv)[:, None].expand(R * Hkv, g)
    return _attend(qf, kf, vf, last_key).reshape(R, H, d).to(q.dtype)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits ``[M, E]`` of ``x[M, H]`` (fp32 router weights: Megatron's ``moe_router_dtype``)."""
    return linear(x.float(), weight.float())


def router_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights[M, k] fp32, ids[M, k] int64)``: top-k of the logits, softmax over the k selected."""
    vals, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(vals, dim=-1, dtype=torch.float32), ids


def _chain_sum(v: torch.Tensor) -> torch.Tensor:
    """``v[..., 0] + v[..., 1] + ...``: a fixed left-to-right order whatever the batch."""
    out = v[..., 0]
    for j in range(1, v.shape[-1]):
        out = out + v[..., j]
    return out


def grouped_topk(scores: torch.Tensor, k: int, num_groups: int | None = None, group_topk: int | None = None):
    """``(values, ids)`` of the top-k of ``scores[M, E]``; with ``group_topk``, only among the ``group_topk``
    groups (of ``num_groups`` consecutive experts) whose top ``k // group_topk`` scores sum highest
    (Megatron's ``group_limited_topk``; the group sum as ``_chain_sum``)."""
    if not group_topk:
        return torch.topk(scores, k, dim=-1)
    M, E = scores.shape
    per_group = scores.view(M, num_groups, E // num_groups)
    group_scores = _chain_sum(per_group.topk(k // group_topk, dim=-1)[0])
    chosen = torch.topk(group_scores, group_topk, dim=-1)[1]
    mask = torch.zeros(M, num_groups, dtype=torch.bool, device=scores.device).scatter_(1, chosen, True)
    mask = mask[:, :, None].expand(M, num_groups, E // num_groups).reshape(M, E)
    return torch.topk(scores.masked_fill(~mask, float("-inf")), k, dim=-1)


def router_route(
    logits: torch.Tensor,
    k: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    expert_bias: torch.Tensor | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    select=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights[M, k] fp32, ids[M, k] int64)`` of fp32 router ``logits[M, E]``, as Megatron-Core routes:

    * softmax, ``pre_softmax=False``: ``router_topk`` (top-k of the logits, softmax over the k);
    * softmax, ``pre_softmax=True``: softmax over all E, top-k of it, no renormalisation;
    * sigmoid: scores ``sigmoid(logits)`` (vector path), the choice on ``scores + expert_bias``, weights the
      chosen scores divided by their sum (``+ 1e-20``, summed in ascending expert id) when ``k > 1``;

    then multiplied by ``scaling_factor``. ``select(choice) -> (_, ids)`` picks the experts instead of
    ``grouped_topk`` (the learner passes its routing replay through it)."""
    if select is None:

        def select(choice):
            return grouped_topk(choice, k, num_groups, group_topk)

    logits = logits.float()
    if score_function == "softmax" and not pre_softmax:
        ids = select(logits)[1]
        weights = torch.softmax(logits.gather(1, ids), dim=-1, dtype=torch.float32)
    elif score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        ids = select(scores)[1]
        weights = scores.gather(1, ids)
    elif score_function == "sigmoid":
        scores = _blocked(torch.sigmoid, logits, pad_value=0.0)
        ids = select(scores if expert_bias is None else scores + expert_bias.float())[1]
        weights = scores.gather(1, ids)
        if k > 1:
            by_id = weights.gather(1, torch.argsort(ids, dim=-1))
            weights = weights / (_chain_sum(by_id)[:, None] + 1e-20)
    else:
        raise ValueError(f"router_route: score_function {score_function!r}; expected 'softmax' or 'sigmoid'")
    if scaling_factor:
        weights = weights * scaling_factor
    return weights, ids


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts ``w13[E, 2I, H]`` (gate | up), ``w2[E, H, I]`` for ``x[M, H]`` routed to ``ids[M, k]``
    with ``weights[M, k]``. As Megatron-Core 0.16's experts: the routing weight scales the activation
    (``w2 @ (swiglu(w13 @ x) * weight)``, cast back to ``x.dtype``); each token's expert outputs are
    then added to zero in ascending expert id, accumulated in fp32 (as torch's CPU ``scatter_add_`` does for
    bf16) and rounded once to ``x.dtype``."""
    M, k = ids.shape
    H = x.shape[-1]
    E = w13.shape[0]
    # every (token, slot) pair grouped by expert, each expert's rows padded to whole tiles of ROW_TILE: all
    # experts' GEMMs in one ``_tile_gemm`` call, each tile with its expert's weights (as ``linear`` per expert)
    pair_ids = ids.reshape(-1)
    order = torch.argsort(pair_ids, stable=True)
    counts = torch.bincount(pair_ids, minlength=E)
    tiles_per = (counts + ROW_TILE - 1) // ROW_TILE
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in ``order``
    first_tile = torch.cumsum(tiles_per, 0) - tiles_per
    sorted_ids = pair_ids[order]
    dest = first_tile[sorted_ids] * ROW_TILE + torch.arange(order.numel(), device=x.device) - first[sorted_ids]
    tile_expert = torch.repeat_interleave(torch.arange(E, device=x.device), tiles_per)
    nt = tile_expert.numel()
    acc = torch.promote_types(torch.promote_types(x.dtype, w13.dtype), torch.float32)
    rows = order // k
    xp = x.new_zeros(nt * ROW_TILE, H).index_copy_(0, dest, x[rows])
    h = _tile_gemm(xp.to(acc).view(nt, ROW_TILE, H), w13[tile_expert].to(acc).transpose(1, 2)).to(x.dtype)
    wp = weights.new_zeros(nt * ROW_TILE).index_copy_(0, dest, weights.reshape(-1)[order])
    a = (swiglu(h.view(nt * ROW_TILE, -1)) * wp[:, None]).to(x.dtype)
    inter = a.shape[-1]
    yp = _tile_gemm(a.to(acc).view(nt, ROW_TILE, inter), w2[tile_expert].to(acc).transpose(1, 2)).to(x.dtype)
    y = x.new_zeros(M * k, H).index_copy_(0, order, yp.view(nt * ROW_TILE, H)[dest]).view(M, k, H)
    order = torch.argsort(ids, dim=-1, stable=True)
    ordered = torch.gather(y, 1, order[:, :, None].expand_as(y))
    # torch's CPU scatter_add_/index_add_ (Megatron's unpermute) accumulate a bf16 output in fp32, in row
    # order, and round once; a bf16 running sum agrees for top-2 only
    out = torch.zeros(M, x.shape[-1], dtype=torch.promote_types(y.dtype, torch.float32))
    for j in range(k):
        out = out + ordered[:, j]
    return out.to(x.dtype)


def token_logprobs(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Log-softmax over the vocabulary of ``logits / temperature`` (fp32), row-wise: SGLang's
    deterministic sampler computes exactly ``F.log_softmax(logits.div_(t), -1)``."""
    return F.log_softmax(logits.float() / temperature, dim=-1)


def kept_token_logprobs(
    logits: torch.Tensor, kept: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """Keep Sampling Mask's log-prob ``[N]`` (fp32) of ``targets[N]`` renormalised over each row's kept set:
    ``log_softmax`` of ``logits[N, V] / temperature`` with the ids outside ``kept[N, V]`` (bool; the target is
    always kept) at ``-inf``, over the whole row, read at the target. Differentiable w.r.t. ``logits``.
    ``temperature``: a number or ``[N, 1]`` (the server's per-request temperatures)."""
    if kept.shape != logits.shape or kept.dtype != torch.bool or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"kept_token_logprobs: expected logits[N, V], kept[N, V] bool and targets[N]; got logits "
            f"{tuple(logits.shape)}, kept {tuple(kept.shape)} {kept.dtype}, targets {tuple(targets.shape)}"
        )
    rows = torch.arange(logits.shape[0], device=logits.device)
    keep = kept.clone()
    keep[rows, targets] = True
    z = logits.float() / temperature
    lsm = F.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    return lsm[rows, targets]
