"""Learner side of the true-on-policy mode: Megatron-Core spec modules and hooks over ``kernels``.

Owns ``exact_layer_spec(spec)`` (the local GPT block spec with every linear, norm and core attention
replaced by a module that calls ``moe_rl.exact.kernels``), ``install_exact_hooks(gpt)`` (the parts a
spec does not reach: each router's ``gating`` and ``routing`` and the output layer, hooked per instance;
``routing`` keeps Megatron's own and turns on, for its call only, ``kernels.router_route`` in place of
Megatron's ``topk_routing_with_score_function``, which moe_rl replaces once by a function that is the stock
one outside an exact router).
``moe_rl.learner.model`` also sets ``activation_func=kernels.silu`` and builds without Megatron's rope.
``GPTModel`` itself is never forked.

RoPE: the model is built with ``position_embedding_type='none'`` and ``ExactCoreAttention`` applies
``kernels.apply_rope`` to the (q/k-normalised) queries and keys itself, with positions read from the
attention mask: a query's position is the number of keys it may see minus one (a padded batch's
causal mask gives 0..T-1, a packed batch's block-diagonal mask restarts at each sequence), exactly
what SGLang's cache holds. Attention then runs with ``kernels.attention``: a padded batch (one mask) in one
call with its sequences as extra heads, a packed batch per sequence.
"""

from __future__ import annotations

import contextvars
import itertools

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import router as megatron_router
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from moe_rl.config.kernels import KERNELS
from moe_rl.exact import kernels as K

ALL = frozenset(KERNELS)

__all__ = [
    "ExactColumnParallelLinear",
    "ExactCoreAttention",
    "ExactRMSNorm",
    "ExactRowParallelLinear",
    "exact_layer_spec",
    "install_exact_hooks",
    "mask_positions",
]


def _exact_linear(mod, input_, w):
    """``kernels.linear_bias``: the layer's bias (q/k/v) inside the fp32 accumulation unless Megatron asked to
    get it back (``skip_bias_add``)."""
    if mod.skip_bias_add:
        return K.linear(input_, w), mod.bias
    return K.linear_bias(input_, w, mod.bias), None


def _tp(mod) -> int:
    """The tensor-parallel ranks ``mod``'s weight is split over (1 for an expert's linear: ``parallel.etp`` is 1)."""
    return 1 if mod.explicit_expert_comm else mod.tp_group.size()


class _FixedOrderReduce(torch.autograd.Function):
    """Forward: every tp rank's fp32 partial gathered and added in ascending rank order, rounded once
    (``kernels.combine_partials``, what ``kernels.linear(tp_blocks=tp)`` computes unsharded); backward: the
    identity, as Megatron's all-reduce (each rank's partial gets the whole output's gradient)."""

    @staticmethod
    def forward(ctx, partial, group, out_dtype):
        parts = [torch.empty_like(partial) for _ in range(group.size())]
        dist.all_gather(parts, partial.contiguous(), group=group)
        return K.combine_partials(parts, out_dtype)

    @staticmethod
    def backward(ctx, g):
        return g.float(), None, None


class ExactColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` whose forward is ``kernels.linear`` / ``linear_bias`` on this rank's output
    columns: the kernel's columns do not depend on the others, so a tp shard's outputs are the unsharded
    kernel's. At tp > 1 the input is gathered (sequence parallel) or copied as Megatron does."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        tp = _tp(self)
        if tp > 1:
            if self.sequence_parallel:
                input_ = gather_from_sequence_parallel_region(input_, group=self.tp_group)
            else:
                input_ = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        out, bias = _exact_linear(self, input_, self.weight if weight is None else weight)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if tp > 1 and gather:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, bias


class ExactRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` whose forward is ``kernels.linear`` / ``linear_bias``. At tp > 1 (TBIK): this rank's
    K block through the kernel in fp32, the ranks' partials combined in a fixed order (``_FixedOrderReduce``),
    then scattered over the sequence (sequence parallel). ``tp_blocks`` (default: the tp size) splits an
    unsharded layer's K the same way, so a tp=1 learner can reproduce a tp=2 one bit for bit."""

    tp_blocks: int | None = None

    def forward(self, input_):
        tp = _tp(self)
        if tp == 1:
            if self.tp_blocks in (None, 1):
                return _exact_linear(self, input_, self.weight)
            if self.bias is not None:
                raise ValueError("true-on-policy: a row-parallel linear's bias with tp_blocks > 1 is not covered")
            return K.linear(input_, self.weight, tp_blocks=self.tp_blocks), None
        if self.bias is not None:
            raise ValueError("true-on-policy: a row-parallel linear's bias at tp > 1 is not covered")
        out = _FixedOrderReduce.apply(K.linear(input_, self.weight, torch.float32), self.tp_group, input_.dtype)
        if self.sequence_parallel:
            out = scatter_to_sequence_parallel_region(out, group=self.tp_group)
        return out, None


class ExactRMSNorm(torch.nn.Module):
    """RMSNorm with ``kernels.rms_norm``; same ``weight`` parameter name as ``torch.nn.RMSNorm``. Sequence-parallel
    capable (unlike Megatron's torch norm): a row's norm needs only that row, and the weight is marked
    ``sequence_parallel`` so that Megatron all-reduces its gradient over the tp ranks."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x):
        return K.rms_norm(x, self.weight, self.eps)


def mask_positions(attention_mask: torch.Tensor, b: int, T: int) -> torch.Tensor:
    """``positions[T]`` of batch row ``b`` from Megatron's boolean mask (True = may not attend).
    Each query must see one contiguous run of keys ending at itself, else ``ValueError``."""
    masked = attention_mask[b if attention_mask.shape[0] > 1 else 0, 0]
    allowed = ~masked
    t = torch.arange(T, device=masked.device)
    first = allowed.int().argmax(-1)
    seen = allowed.sum(-1)
    if not bool((seen == t - first + 1).all()) or not bool(allowed[t, t].all()):
        raise ValueError("true-on-policy attention needs causal (or block-diagonal causal) masks")
    return t - first


class ExactCoreAttention(MegatronModule):
    """Core attention (rope + causal softmax attention) with ``kernels``; replaces DotProductAttention."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        **_unused,
    ):
        super().__init__(config=config)
        self.rot_dim = config.kv_channels  # install_exact_hooks sets the model's rotary dim and base
        self.rotary_base = None

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("true-on-policy attention: packed_seq_params / attention_bias are not supported")
        if self.rotary_base is None:
            raise RuntimeError("ExactCoreAttention used before install_exact_hooks set the rotary base")
        T, B, H, d = query.shape
        if attention_mask is None:
            attention_mask = torch.ones(T, T, dtype=torch.bool, device=query.device).triu(1).view(1, 1, T, T)
        out = query.new_empty(T, B, H, d)
        # one mask for the whole batch (a padded batch): every row in one call, its sequences as extra heads
        # (the kernels compute each head alone); a packed batch's rows one at a time
        groups = [range(B)] if attention_mask.shape[0] == 1 else [range(b, b + 1) for b in range(B)]
        for rows in groups:
            pos = mask_positions(attention_mask, rows[0], T)
            starts = (pos == 0).nonzero().flatten().tolist() + [T]
            r = slice(rows[0], rows[-1] + 1)
            for s0, s1 in itertools.pairwise(starts):
                cos, sin = K.rope_cos_sin(pos[s0:s1], self.rot_dim, self.rotary_base)
                q = K.apply_rope(query[s0:s1, r].reshape(s1 - s0, -1, d), cos, sin)
                k = K.apply_rope(key[s0:s1, r].reshape(s1 - s0, -1, key.shape[-1]), cos, sin)
                v = value[s0:s1, r].reshape(s1 - s0, -1, value.shape[-1])
                out[s0:s1, r] = K.attention(q, k, v, start=0).view(s1 - s0, len(rows), H, d)
        return out.view(T, B, H * d)


def _swap(obj, table):
    """Replace, in a ModuleSpec tree, every ``module`` class found in ``table`` (in place)."""

    if isinstance(obj, ModuleSpec):
        if obj.module in table:
            obj.module = table[obj.module]
        _swap(obj.submodules, table)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _swap(x, table)
    elif obj is not None and hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            val = getattr(obj, name)
            if isinstance(val, type) and val in table:
                setattr(obj, name, table[val])
            else:
                _swap(val, table)


def exact_layer_spec(spec, kernels: frozenset[str] = ALL):
    """The local (non-TE) block ``spec`` with kernels-backed linears, norms and core attention (those of
    them among the contract's ``kernels``)."""

    table = {}
    if "linear" in kernels:
        table |= {ColumnParallelLinear: ExactColumnParallelLinear, RowParallelLinear: ExactRowParallelLinear}
    if "attention" in kernels:
        table[DotProductAttention] = ExactCoreAttention
    if "rmsnorm" in kernels:
        table[WrappedTorchNorm] = ExactRMSNorm
        try:
            from megatron.core.fusions.fused_layer_norm import FusedLayerNorm  # noqa: PLC0415 -- optional dependency (guarded by its ImportError)

            table[FusedLayerNorm] = ExactRMSNorm
        except ImportError:  # pragma: no cover - depends on the Megatron build
            pass
    _swap(spec, table)
    return spec


def install_exact_hooks(gpt, rotary_base: float, rotary_dim: int, kernels: frozenset[str] = ALL) -> None:
    """Per-instance hooks on the bare ``GPTModel`` ``build_model`` just built (before any wrapper): routers'
    gating (``router``) and the output layer (``lm_head``) use ``kernels``; every ``ExactCoreAttention`` gets the
    rotary base. With the whole contract, refuses a model the spec did not cover."""

    leftovers = []
    for name, mod in gpt.named_modules():
        if isinstance(mod, ExactCoreAttention):
            mod.rotary_base, mod.rot_dim = float(rotary_base), int(rotary_dim)
        elif isinstance(mod, TopKRouter):
            if "router" in kernels:
                mod.gating = _gating(mod)
                mod.routing = _routing(mod)
        elif (
            type(mod) in (ColumnParallelLinear, RowParallelLinear)
            and name != "output_layer"
            or type(mod).__name__ in ("DotProductAttention", "RMSNorm", "LayerNorm")
        ):
            leftovers.append(name)
    if leftovers and kernels == ALL:
        raise ValueError(f"true-on-policy: modules outside the exact kernels: {leftovers}")
    if getattr(gpt, "output_layer", None) is not None and "lm_head" in kernels:
        out = gpt.output_layer

        def output_forward(input_, weight=None, runtime_gather_output=None):
            # fp32 logits, as the server's LM head (sglang_hooks._lm_head): in bf16 a bf16 cast here
            # alone moves a log-prob by up to ~1e-3. At tp > 1 this rank's vocabulary columns, as Megatron's.
            if out.tp_group.size() > 1:
                gather = out.sequence_parallel
                region = gather_from_sequence_parallel_region if gather else copy_to_tensor_model_parallel_region
                input_ = region(input_, group=out.tp_group)
            return K.linear(input_, out.weight if weight is None else weight, out_dtype=torch.float32), None

        out.forward = output_forward


def _gating(router):
    if router.bias is not None:
        raise ValueError("true-on-policy: a router bias is not covered by the exact kernels")

    def gating(input):
        return K.router_logits(input, router.weight)

    return gating


_EXACT_ROUTING = contextvars.ContextVar("moe_rl_exact_routing", default=False)
_STOCK_TOPK_ROUTING = megatron_router.topk_routing_with_score_function


def _topk_routing(
    logits,
    topk,
    use_pre_softmax=False,
    num_groups=None,
    group_topk=None,
    scaling_factor=None,
    score_function="softmax",
    expert_bias=None,
    fused=False,
    router_replay=None,
):
    """Megatron's ``topk_routing_with_score_function`` (same signature and outputs: dense ``probs`` and
    ``routing_map [tokens, E]``), through ``kernels.router_route`` inside an exact router's ``routing``; the
    stock function everywhere else. A routing replay picks the experts through Megatron's hook as usual."""
    if not _EXACT_ROUTING.get():
        return _STOCK_TOPK_ROUTING(
            logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, expert_bias,
            fused, router_replay,
        )  # fmt: skip

    def compute(scores, k, n_groups=None, g_topk=None):
        return K.grouped_topk(scores, k, n_groups, g_topk)

    def select(choice):
        if router_replay is None:
            return compute(choice, topk, num_groups, group_topk)
        return router_replay.get_replay_topk(choice, topk, num_groups, group_topk, compute)

    probs, ids = K.router_route(
        logits, topk, score_function, use_pre_softmax, expert_bias, num_groups, group_topk, scaling_factor, select
    )
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, ids, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, ids, 1).bool()
    return routing_probs, routing_map


def _routing(router):
    """``router.routing`` (Megatron's own: z-loss, aux losses, the expert-bias token counts) with its top-k
    routing through ``kernels.router_route``."""
    if router.config.moe_router_fusion:
        raise ValueError("true-on-policy: model.moe_router_fusion=true routes with TE's fused kernel; set it false")
    if megatron_router.topk_routing_with_score_function is not _topk_routing:
        megatron_router.topk_routing_with_score_function = _topk_routing
    stock = router.routing

    def routing(logits, padding_mask=None):
        token = _EXACT_ROUTING.set(True)
        try:
            return stock(logits, padding_mask=padding_mask)
        finally:
            _EXACT_ROUTING.reset(token)

    return routing
