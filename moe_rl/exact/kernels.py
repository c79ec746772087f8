"""The shared CPU kernels of the true-on-policy mode (``rollout.true_on_policy``).

Owns every op whose rounding decides a token's log-prob or a router decision, written so that a
row's result depends only on that row (never on how many rows are computed with it, on the padded
length, or on whether the row is a prefill or a decode step). The patched SGLang CPU path
(``moe_rl.exact.sglang_hooks``) and the Megatron-Core learner (``moe_rl.learner.exact_spec``) both
call these functions, so both sides round identically. Pure torch, no moe_rl imports: the SGLang
server process imports this module.

How each op is made row-invariant (torch 2.13 CPU):

* matmul (``linear``): products ``x[m, None, :] * w[None, :, :]`` (an IEEE multiply: identical
  anywhere) summed over the contiguous last dim with ``sum(-1)``. Torch reduces each output element
  serially over that dim with a fixed vectorised cascade that depends only on its length, and
  parallelises over output elements only (there are always several). BLAS would pick a kernel by M.
* transcendental elementwise ops (``silu``, ``cos``/``sin``, ``pow``): torch's vectorised loop uses
  SLEEF for whole vectors and the scalar libm function for a tail, which can differ by one ulp, and
  the tail depends on the tensor's size and on the thread split. ``_blocked`` pads to whole blocks of
  ``BLOCK`` elements (below torch's parallel grain, a multiple of every vector width), so every element
  takes the vector path.
* attention (``attention``): each query attends over exactly the keys at positions 0..its own, one
  query at a time (the KV split is "one block of all visible keys" in prefill and decode alike), with
  row-wise ``softmax``. A padded / masked row would change the reduction length.
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

__all__ = [
    "BLOCK",
    "add_rms_norm",
    "apply_rope",
    "attention",
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

BLOCK = 8192  # elements per elementwise call: < torch's GRAIN_SIZE (32768), multiple of 64
_ROW_BUDGET = 1 << 21  # elements of the [rows, N, K] product materialised at once by ``linear``


def _blocked(fn, x: torch.Tensor, pad_value: float = 1.0) -> torch.Tensor:
    """``fn`` applied elementwise with every element on torch's vector path (see module doc)."""
    flat = x.contiguous().reshape(-1)
    n = flat.numel()
    pad = (-n) % BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_full((pad,), pad_value)])
    out = torch.cat([fn(flat[i : i + BLOCK]) for i in range(0, n + pad, BLOCK)]) if n else flat
    return out[:n].view(x.shape)


def _rowwise_matmul(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x2[M, K] @ w[N, K].T`` in fp32 (or the inputs' dtype when wider), each row alone."""
    M, K = x2.shape
    N = w.shape[0]
    acc = torch.promote_types(torch.promote_types(x2.dtype, w.dtype), torch.float32)
    xa, wa = x2.to(acc), w.to(acc)
    step = max(1, _ROW_BUDGET // max(1, N * K))
    parts = [(xa[i : i + step, None, :] * wa[None, :, :]).sum(-1) for i in range(0, M, step)]
    return torch.cat(parts) if parts else xa.new_zeros((0, N))


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


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x[..., K] @ w[N, K].T`` -> ``[..., N]``, row-invariant; accumulated in fp32, cast to ``out_dtype``
    (default ``x.dtype``)."""
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"linear: x has K={x.shape[-1]}, weight has K={w.shape[-1]}")
    return _Linear.apply(x, w, out_dtype or x.dtype)


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
    ``0 .. start+i``. GQA by head groups; scale ``d ** -0.5``; fp32 inside; output ``[n, H, d]``."""
    n, H, d = q.shape
    Hkv = k.shape[1]
    if H % Hkv:
        raise ValueError(f"attention: {H} query heads are not a multiple of {Hkv} key/value heads")
    g = H // Hkv
    scale = d**-0.5
    kt = k.float().permute(1, 0, 2).contiguous()  # [Hkv, L, d]
    vt = v.float().permute(1, 2, 0).contiguous()  # [Hkv, d, L]
    qf = q.float().reshape(n, Hkv, g, d)
    outs = []
    for i in range(n):
        L = start + i + 1
        s = (qf[i][:, :, None, :] * kt[:, None, :L, :]).sum(-1) * scale  # [Hkv, g, L]
        p = torch.softmax(s, dim=-1)
        outs.append((p[:, :, None, :] * vt[:, None, :, :L]).sum(-1))  # [Hkv, g, d]
    out = torch.stack(outs) if outs else qf.new_zeros((0, Hkv, g, d))
    return out.reshape(n, H, d).to(q.dtype)


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
    y = torch.zeros(M, k, x.shape[-1], dtype=x.dtype)
    for e in torch.unique(ids).tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        a = swiglu(linear(x[rows], w13[e]))
        a = (a * weights[rows, slots, None]).to(x.dtype)
        y[rows, slots] = linear(a, w2[e])
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
