"""Router alignment metrics: how often two routings of the same tokens pick different expert sets.

Owns the flip-rate math and its accumulation over microbatches. Inputs are routes captured
during passes that run anyway (``RouteCapture``), so no extra forward is needed.
A flip at (token, layer) means the two top-k expert *sets* differ (order is irrelevant).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["FlipCounter", "expert_set_flips", "routes_vs_map_flips"]


def expert_set_flips(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a[..., L, K]``, ``b[..., L, K]`` expert ids -> ``flips[..., L]`` bool (sets differ)."""
    if a.shape != b.shape:
        raise ValueError(
            f"routes to compare must have the same shape [..., L, K]; got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


def routes_vs_map_flips(routes: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
    """``routes[..., L, K]`` expert ids vs dispatched ``maps[..., L, E]`` bool -> ``flips[..., L]``.

    A flip: the set of ``K`` ids differs from the experts the map marks (a dropped or an extra
    expert counts).
    """
    if routes.shape[:-1] != maps.shape[:-1]:
        raise ValueError(
            f"routes[..., L, K] and maps[..., L, E] must agree on [..., L]; got {tuple(routes.shape)} "
            f"and {tuple(maps.shape)}"
        )
    ref = torch.zeros(maps.shape, dtype=torch.bool, device="cpu")  # host-side comparison
    ref.scatter_(-1, routes.to(torch.int64).cpu(), True)
    return (ref != maps.cpu()).any(dim=-1)


class FlipCounter:
    """Accumulates flips of one comparison (e.g. rollout vs learner-natural) over microbatches.

    ``layer_ids`` are the global MoE-layer indices of the compared layers (the names in the
    summary). ``summary()`` gives ``{name}/flip_rate`` (over valid token-layers),
    ``{name}/flip_rate/layer{l}`` and ``{name}/tokens_with_flip`` (fraction of valid tokens with
    at least one flipped layer).
    """

    def __init__(self, name: str, layer_ids: Sequence[int]):
        self.name = name
        self.layer_ids = list(layer_ids)
        # host-side counters: the per-microbatch flips are summed on the GPU, then moved here
        self.layer_flips = torch.zeros(len(self.layer_ids), dtype=torch.float64, device="cpu")
        self.tokens = 0
        self.tokens_any = 0

    def add(self, reference: torch.Tensor, other: torch.Tensor, valid: torch.Tensor) -> None:
        """Count ``reference[B, S, L, K]`` vs ``other[B, S, L, K]`` on tokens where ``valid[B, S]``."""
        if reference.dim() != 4 or reference.shape[2] != len(self.layer_ids):
            raise ValueError(
                f"{self.name}: routes must be [B, S, L={len(self.layer_ids)}, K]; got {tuple(reference.shape)}"
            )
        if valid.shape != reference.shape[:2]:
            want = tuple(reference.shape[:2])
            raise ValueError(f"{self.name}: valid must be [B, S]={want}; got {tuple(valid.shape)}")
        self.add_flips(expert_set_flips(reference.cpu(), other.cpu()), valid)

    def add_flips(self, flips: torch.Tensor, valid: torch.Tensor) -> None:
        """Count ``flips[B, S, L]`` (bool) on tokens where ``valid[B, S]`` (host-side counters)."""
        flips = flips.cpu()[valid.cpu().bool()]  # [N_valid, L]
        self.layer_flips += flips.sum(dim=0).double()
        self.tokens += int(flips.shape[0])
        self.tokens_any += int(flips.any(dim=-1).sum())

    def all_reduce(self, group=None) -> None:
        """Sum the counts over ``group`` (data-parallel ranks see different tokens); in place."""

        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        counts = torch.tensor([self.tokens, self.tokens_any], dtype=torch.float64, device="cpu")
        packed = torch.cat([self.layer_flips, counts])
        if dist.get_backend(group) == "nccl":  # NCCL reduces device tensors only
            packed = packed.cuda()
        dist.all_reduce(packed, group=group)
        packed = packed.cpu()
        self.layer_flips = packed[:-2]
        self.tokens, self.tokens_any = int(packed[-2]), int(packed[-1])

    def summary(self) -> dict[str, float]:
        if self.tokens == 0:
            return {}
        out = {
            f"{self.name}/flip_rate": float(self.layer_flips.sum() / (self.tokens * len(self.layer_ids))),
            f"{self.name}/tokens_with_flip": self.tokens_any / self.tokens,
        }
        for lid, n in zip(self.layer_ids, self.layer_flips.tolist()):
            out[f"{self.name}/flip_rate/layer{lid}"] = n / self.tokens
        return out
