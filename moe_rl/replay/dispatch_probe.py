"""What every MoE router actually handed to the token dispatcher, per forward.

Owns forward hooks on the ``TopKRouter`` of every MoE decoder layer — all of them, whether
or not a ``RoutingReplay`` is bound to the model — that keep the router's output
``routing_map[S*B, E]`` (the experts the dispatcher receives). Comparing the rollout's routes
with these maps is the replay check that can fail: a router left out of the binding, a fused
router that skips the replay hook, capacity dropping, or a wrong layout all show up as flips
(field-facts.md, "Replay silently off is the most reported failure"). Forwards re-run inside
backward (activation recompute) are not recorded twice. It never changes a route.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.utils import unwrap_model

from moe_rl.replay.binding import moe_layer_pattern
from moe_rl.replay.layer_hook import in_backward

__all__ = ["DispatchCapture", "DispatchProbe"]


class DispatchCapture:
    """Routing maps seen inside one ``DispatchProbe.capture()``: ``maps(i)`` -> ``[B, S_local, L_local, E]``."""

    def __init__(self, num_layers: int):
        self._maps: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._shapes: list[list[tuple[int, int]]] = [[] for _ in range(num_layers)]

    @property
    def num_forwards(self) -> int:
        return min((len(m) for m in self._maps), default=0)

    def maps(self, i: int) -> torch.Tensor:
        """Forward ``i``'s dispatched experts as a bool map ``[B, S_local, L_local, E]``."""
        if not 0 <= i < self.num_forwards:
            raise IndexError(f"no routing map for forward #{i}; the probe saw {self.num_forwards} forward(s)")
        per_layer = []
        for maps, shapes in zip(self._maps, self._shapes):
            S, B = shapes[i]
            per_layer.append(maps[i].reshape(S, B, -1).transpose(0, 1))  # rows are s*B + b
        return torch.stack(per_layer, dim=2)


class DispatchProbe:
    """Hooks on all MoE routers of ``model.decoder``; ``capture()`` collects their routing maps."""

    def __init__(self, model):
        model = unwrap_model(model)
        pattern = moe_layer_pattern(model.config)
        self.moe_layer_ids: list[int] = []
        self._routers: list[TopKRouter] = []
        for layer in model.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if isinstance(router, TopKRouter):
                self.moe_layer_ids.append(sum(pattern[: layer.layer_number - 1]))
                self._routers.append(router)
        if not self._routers:
            raise ValueError("model has no MoE router in model.decoder.layers; nothing to observe")
        self._capture: DispatchCapture | None = None
        self._pending: list[tuple[int, int] | None] = [None] * len(self._routers)
        self._hooks = []
        for j, router in enumerate(self._routers):
            self._hooks.append(router.register_forward_pre_hook(self._pre_hook(j)))
            self._hooks.append(router.register_forward_hook(self._post_hook(j)))

    def _pre_hook(self, j: int):
        def hook(module, args):
            hidden = args[0]  # router input [S, B, H]
            self._pending[j] = (int(hidden.shape[0]), int(hidden.shape[1]))

        return hook

    def _post_hook(self, j: int):
        def hook(module, args, output):
            cap = self._capture
            if cap is None or in_backward():
                return
            routing_map = output[1]
            cap._maps[j].append(routing_map.detach().to("cpu", copy=True).bool())
            cap._shapes[j].append(self._pending[j])

        return hook

    @contextlib.contextmanager
    def capture(self) -> Iterator[DispatchCapture]:
        """Record the routing map of every forward inside the context (not nestable)."""
        if self._capture is not None:
            raise RuntimeError("a DispatchProbe.capture() is already active; captures do not nest")
        self._capture = DispatchCapture(len(self._routers))
        try:
            yield self._capture
        finally:
            self._capture = None

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
