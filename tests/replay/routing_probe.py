"""Test helper: what Megatron's routers actually dispatched, read from their forward outputs."""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter

from tests.conftest import session_device


class RoutingMapProbe:
    """Collects every decoder router's ``routing_map[S*B, E]`` per call (forward and recompute)."""

    def __init__(self, model):
        while hasattr(model, "module"):
            model = model.module
        self.maps: dict[int, list[torch.Tensor]] = {}
        self.hooks = []
        for idx, layer in enumerate(model.decoder.layers):
            router = getattr(layer.mlp, "router", None)
            if isinstance(router, TopKRouter):
                self.maps[idx] = []
                self.hooks.append(router.register_forward_hook(self._hook(idx)))

    def _hook(self, idx):
        def hook(module, args, output):
            self.maps[idx].append(output[1].detach().clone())

        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()


def expected_map(routes_bslk: torch.Tensor, layer: int, num_experts: int) -> torch.Tensor:
    """``routing_map[S*B, E]`` that routes ``[B, S, L, K]`` should produce for one layer (row s*B + b)."""
    B, S, _, _K = routes_bslk.shape
    out = torch.zeros(S * B, num_experts, dtype=torch.bool, device=routes_bslk.device)
    for b in range(B):
        for s in range(S):
            for e in routes_bslk[b, s, layer].tolist():
                out[s * B + b, e] = True
    return out


def random_routes(B: int, S: int, L: int, K: int, E: int, seed: int, device=None) -> torch.Tensor:
    """Distinct random experts ``[B, S, L, K]`` on ``device`` (default: the session device)."""
    g = torch.Generator().manual_seed(seed)  # CPU generator: the same routes on every device
    return torch.argsort(torch.rand(B, S, L, E, generator=g), dim=-1)[..., :K].to(device or session_device())
