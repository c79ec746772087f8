"""Routing replay bound to one built Megatron-Core model: record and replay MoE routes.

Owns the per-router replay state of one model instance and the stage switch, exposed as
context managers (``record()`` / ``replay(routes)``). It drives Megatron's own hook
(``TopKRouter.router_replay.get_replay_topk``, megatron/core/transformer/moe/router_replay.py)
and must not keep module-global state or read environment variables.

Design decision on Megatron's class-level ``RouterReplay.global_router_replay_instances``:
a ``RoutingReplay`` takes ownership of its model's routers. Each router's Megatron
``RouterReplay`` is removed from the global list and replaced by a ``LayerReplay`` (a
``RouterReplay`` subclass) that never enters it. The global list therefore never holds a
bound model (building a second model cannot shift its layers), and Megatron's static
``set_global_*`` helpers cannot reach it: only this object's context managers can.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.utils import unwrap_model

from moe_rl.replay.layer_hook import LayerReplay, PassState, ReplayError, RouteCapture
from moe_rl.replay.layout import (
    check_routes,
    context_parallel_shard,
    sequence_parallel_shard,
    to_megatron_layout,
)

__all__ = ["ReplayError", "RouteCapture", "RoutingReplay", "moe_layer_pattern", "unsupported_router_options"]


def unsupported_router_options(tcfg) -> list[str]:
    """Router options of a Megatron ``TransformerConfig`` under which replay is bypassed or broken."""
    bad = []
    if getattr(tcfg, "moe_router_fusion", False):
        bad.append("moe_router_fusion=True (the fused top-k kernel never calls the replay hook)")
    balancing = getattr(tcfg, "moe_router_load_balancing_type", None)
    balancing = balancing if isinstance(balancing, (list, tuple)) else [balancing]
    for kind in ("sinkhorn", "quantile_balancing"):  # quantile_balancing: megatron-core 0.19+
        if kind in balancing:
            bad.append(f"moe_router_load_balancing_type={kind!r} ({kind} routing bypasses the replay hook)")
    if getattr(tcfg, "moe_expert_capacity_factor", None) is not None:
        bad.append(
            f"moe_expert_capacity_factor={tcfg.moe_expert_capacity_factor} "
            "(capacity dropping would drop replayed assignments)"
        )
    if not getattr(tcfg, "moe_enable_routing_replay", False):
        bad.append("moe_enable_routing_replay=False (routers have no replay hook; build with it True)")
    return bad


def moe_layer_pattern(tcfg) -> list[int]:
    """Per decoder layer of a Megatron ``TransformerConfig``: 1 = MoE, 0 = dense (from ``moe_layer_freq``)."""
    freq = tcfg.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(tcfg.num_layers)]
    return [int(x) for x in freq]


def _layer_recompute(tcfg, local_idx: int) -> str | None:
    """How Megatron re-runs this decoder layer's router inside backward (transformer_block.py,
    moe_layer.py): full recompute only in training mode, selective "moe" always."""
    if tcfg.recompute_granularity == "full":
        if tcfg.recompute_method == "block" and local_idx >= (tcfg.recompute_num_layers or 0):
            return None
        return "full"
    if tcfg.recompute_granularity == "selective" and "moe" in (tcfg.recompute_modules or []):
        return "selective"
    return None


class RoutingReplay:
    """Record / replay the routes of one built Megatron-Core ``GPTModel`` (or one PP stage of it).

    ``RoutingReplay(model)`` finds the ``TopKRouter`` of every MoE decoder layer in layer order
    (dense layers have none; MTP layers live outside ``model.decoder`` and are only detached
    from the global list, so they always route naturally) and takes ownership of their replay
    hooks. Routes are given per microbatch as ``routes[B, S, L_moe, K]`` (any int dtype, all
    MoE layers of the whole model, full sequence); this object picks its stage's layers and its
    sequence / context-parallel shard and converts to Megatron's ``[S*B, K]`` int64 layout.
    """

    def __init__(self, model):
        self.model = unwrap_model(model)
        tcfg = self.model.config
        bad = unsupported_router_options(tcfg)
        if bad:
            raise ValueError("routing replay cannot be trusted with this model config: " + "; ".join(bad))
        self.config = tcfg
        pattern = moe_layer_pattern(tcfg)
        self.num_moe_layers = sum(pattern)
        self.top_k = tcfg.moe_router_topk
        self.num_experts = tcfg.num_moe_experts
        self._state = PassState()
        self.layers: list[LayerReplay] = []
        self.moe_layer_ids: list[int] = []  # global MoE-layer index of each local router
        self._routers: list[TopKRouter] = []
        decoder_routers = set()
        for local_idx, layer in enumerate(self.model.decoder.layers):
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if not isinstance(router, TopKRouter):
                continue
            moe_index = sum(pattern[: layer.layer_number - 1])  # layer_number is global, 1-based
            layer_replay = LayerReplay(self._state, moe_index, _layer_recompute(tcfg, local_idx))
            self._adopt(router, layer_replay)
            self.layers.append(layer_replay)
            self.moe_layer_ids.append(moe_index)
            self._routers.append(router)
            decoder_routers.add(id(router))
        # MTP (and any other) routers: detach from the global list, leave the hook idle.
        self._idle_routers = [
            m for m in self.model.modules() if isinstance(m, TopKRouter) and id(m) not in decoder_routers
        ]
        for router in self._idle_routers:
            self._adopt(router, LayerReplay(self._state, -1, None))
        if not self.layers:
            raise ValueError("model has no MoE router in model.decoder.layers; nothing to replay")
        self._hooks = [self.model.register_forward_pre_hook(self._on_model_forward)]
        for layer, router in zip(self.layers, self._routers):
            self._hooks.append(router.register_forward_pre_hook(self._shape_hook(layer)))
        self._active = False

    @staticmethod
    def _adopt(router: TopKRouter, replacement: LayerReplay) -> None:
        old = router.router_replay
        if isinstance(old, LayerReplay) and not old.released:
            raise RuntimeError(
                "this model is already bound to a RoutingReplay; reuse it (or close() it first) -- two bindings "
                "would leave the first one driving detached hooks, i.e. silently natural routing"
            )
        if old is not None and any(inst is old for inst in RouterReplay.global_router_replay_instances):
            RouterReplay.global_router_replay_instances[:] = [
                inst for inst in RouterReplay.global_router_replay_instances if inst is not old
            ]
        router.router_replay = replacement

    def _on_model_forward(self, module, args) -> None:
        self._state.grad_at_entry = torch.is_grad_enabled()
        self._state.training = module.training

    @staticmethod
    def _shape_hook(layer: LayerReplay):
        def hook(module, args):
            hidden = args[0]
            layer.pending_shape = (int(hidden.shape[0]), int(hidden.shape[1]))  # router input [S, B, H]

        return hook

    # ------------------------------------------------------------------ stages
    @contextlib.contextmanager
    def record(self) -> Iterator[RouteCapture]:
        """Natural routing; every forward's top-k is captured (``capture.recorded(i)``)."""
        with self._stage(RouterReplayAction.RECORD, observe_natural=False) as capture:
            yield capture

    @contextlib.contextmanager
    def replay(
        self, microbatches: Sequence[torch.Tensor], *, local: bool = False, observe_natural: bool = True
    ) -> Iterator[RouteCapture]:
        """Forward ``i`` inside the context uses ``microbatches[i]`` (``routes[B, S, L_moe, K]``).

        ``local=True``: routes are already this rank's ``[B, S_local, L_local, K]`` (as a
        ``RouteCapture`` returns them; used by R2). On a clean exit every microbatch must have
        been consumed exactly once by every layer, and every recompute entry popped; otherwise
        ``ReplayError``. Keep the backward of a recomputed model inside the context.
        ``observe_natural`` also captures the natural top-k (one extra top-k per layer).
        """
        per_layer = [self._to_local(r, i, local) for i, r in enumerate(microbatches)]
        with self._stage(RouterReplayAction.REPLAY_FORWARD, observe_natural=observe_natural) as capture:
            for j, layer in enumerate(self.layers):
                layer.forward_queue.extend(mb[j] for mb in per_layer)
                layer.given = len(per_layer)
            yield capture
            self._check_consumed(len(per_layer))

    def _to_local(self, routes: torch.Tensor, i: int, local: bool) -> torch.Tensor:
        if not torch.is_tensor(routes) or routes.dim() != 4:
            got = getattr(routes, "shape", type(routes))
            raise ValueError(f"microbatches[{i}] must be a tensor routes[B, S, L_moe, K]; got {got}")
        L = len(self.layers) if local else self.num_moe_layers
        if routes.shape[2:] != (L, self.top_k):
            raise ValueError(
                f"microbatches[{i}] must be routes[B, S, L_moe={L}, K={self.top_k}]; got shape {tuple(routes.shape)}"
            )
        if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
            raise ValueError(f"microbatches[{i}] must hold integer expert ids; got dtype {routes.dtype}")
        check_routes(routes, self.num_experts, field=f"microbatches[{i}]")
        # one host->device copy per microbatch here rather than one per layer per forward
        device = self._routers[0].weight.device
        if local:
            return to_megatron_layout(routes).to(device)
        tcfg = self.config
        routes = routes[:, :, self.moe_layer_ids]
        if tcfg.context_parallel_size > 1:
            cp_rank = parallel_state.get_context_parallel_rank()
            routes = context_parallel_shard(routes, tcfg.context_parallel_size, cp_rank)
        per_layer = to_megatron_layout(routes)
        if tcfg.sequence_parallel and tcfg.tensor_model_parallel_size > 1:
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            per_layer = sequence_parallel_shard(per_layer, routes.shape[0], tcfg.tensor_model_parallel_size, tp_rank)
        return per_layer.to(device)

    @contextlib.contextmanager
    def _stage(self, action: RouterReplayAction, observe_natural: bool) -> Iterator[RouteCapture]:
        if not self._hooks:
            raise RuntimeError("this RoutingReplay was closed; bind the model again")
        if self._active:
            raise RuntimeError("a record()/replay() context is already active on this model; they do not nest")
        self._active = True
        self._state.observe_natural = observe_natural
        capture = RouteCapture(layers=self.layers)
        for layer in self.layers:
            layer.reset()
            layer.set_router_replay_action(action)
        try:
            yield capture
        finally:
            capture._freeze()
            # Nothing survives the context: Megatron's FIFO, targets, queues and the action.
            for layer in self.layers:
                layer.reset()
            self._active = False

    def _check_consumed(self, given: int) -> None:
        for layer in self.layers:
            used = len(layer.applied)
            if used != given or layer.forward_queue:
                raise ReplayError(
                    f"MoE layer {layer.moe_index}: {given} microbatch route set(s) given but {used} consumed; "
                    "each must be used by exactly one forward"
                )
            if layer.replay_backward_list:
                raise ReplayError(
                    f"MoE layer {layer.moe_index}: {len(layer.replay_backward_list)} recompute route set(s) never "
                    "consumed; run backward inside the replay() context"
                )

    def close(self) -> None:
        """Release the routers: remove this object's hooks; their idle replay objects may be re-adopted."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for layer in self.layers:
            layer.reset()
            layer.released = True
