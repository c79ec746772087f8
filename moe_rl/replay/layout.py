"""Route layout conversions between the rollout records and Megatron's routers.

Records hold per sample ``routes[rows, L_moe, K]`` (compact uint8/uint16, row ``t`` = input
position ``t`` of ``tokens[:-1]``). A Megatron ``TopKRouter`` sees the local tokens of one
microbatch flattened sequence-major: ``[S*B, K]`` int64 with row ``s*B + b``. This module
owns packing samples into microbatches, padding, and sharding by sequence (sequence /
context parallel). It must not touch models.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from moe_rl.records.routes import pad_routes

__all__ = [
    "check_routes",
    "context_parallel_shard",
    "from_megatron_layout",
    "pack_microbatch_routes",
    "sequence_parallel_positions",
    "sequence_parallel_shard",
    "to_megatron_layout",
]


def check_routes(routes: torch.Tensor, num_experts: int, field: str = "routes") -> None:
    """Raise one clear error unless ``routes[..., K]`` are distinct expert ids in ``[0, num_experts)``."""
    if routes.numel() == 0:
        return
    lo, hi = int(routes.min()), int(routes.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"{field}: expert ids must be in [0, {num_experts}); got range [{lo}, {hi}]")
    if routes.shape[-1] > 1:
        ordered = routes.sort(dim=-1).values
        dup = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
        if bool(dup.any()):
            where = tuple(int(i) for i in dup.nonzero()[0])
            # duplicated experts collapse in Megatron's routing map (field-facts.md bug #3)
            raise ValueError(
                f"{field}{list(where)} repeats an expert: {routes[where].tolist()}; top-k ids must be distinct"
            )


def pack_microbatch_routes(
    sample_routes: Sequence[np.ndarray | torch.Tensor], seq_len: int, num_experts: int, first_sample: int = 0
) -> torch.Tensor:
    """Per-sample ``routes_i[n_i, L, K]`` -> ``routes[B, T=seq_len, L, K]`` int64, right-padded.

    Position ``t >= n_i`` (padding, or the last token that has no route) gets a pad row with
    distinct experts spread over all experts (``moe_rl.records.pad_routes``), so padded tokens
    neither collapse in the routing map nor pile onto one expert. ``first_sample`` offsets the
    pad pattern so consecutive microbatches keep spreading.
    """
    if not sample_routes:
        raise ValueError("sample_routes is empty; expected one [rows, L, K] array per sample")
    shapes = {tuple(r.shape[1:]) for r in sample_routes}
    if len(shapes) != 1 or any(r.ndim != 3 for r in sample_routes):
        got = [tuple(r.shape) for r in sample_routes]
        raise ValueError(f"every sample route must be [rows, L, K] with the same L, K; got shapes {got}")
    L, K = shapes.pop()
    out = np.empty((len(sample_routes), seq_len, L, K), dtype=np.int64)
    for b, r in enumerate(sample_routes):
        r = r.cpu().numpy() if torch.is_tensor(r) else np.asarray(r)
        n = r.shape[0]
        if n > seq_len:
            raise ValueError(
                f"sample {first_sample + b} has {n} route rows but the microbatch is only seq_len={seq_len} positions"
            )
        out[b, :n] = r
        start = (first_sample + b) * seq_len + n
        out[b, n:] = pad_routes(seq_len - n, L, K, num_experts, start=start)
    routes = torch.from_numpy(out)  # host-built; RoutingReplay moves it to the routers' device once
    check_routes(routes, num_experts)
    return routes


def to_megatron_layout(routes: torch.Tensor) -> torch.Tensor:
    """``routes[B, S, L, K]`` (any int dtype) -> ``per_layer[L, S*B, K]`` int64, row ``s*B + b``.

    Megatron's router flattens its ``[S, B, H]`` input sequence-major, and ``scores.gather``
    needs int64 indices (int16 raises).
    """
    if routes.dim() != 4:
        raise ValueError(f"routes must be [B, S, L, K]; got shape {tuple(routes.shape)}")
    B, S, L, K = routes.shape
    return routes.permute(2, 1, 0, 3).reshape(L, S * B, K).to(torch.int64)


def from_megatron_layout(per_layer: torch.Tensor | Sequence[torch.Tensor], batch_size: int) -> torch.Tensor:
    """``per_layer[L, S*B, K]`` (or a list of ``[S*B, K]``) -> ``routes[B, S, L, K]``."""
    if not torch.is_tensor(per_layer):
        per_layer = torch.stack(list(per_layer))
    L, SB, K = per_layer.shape
    if SB % batch_size:
        raise ValueError(f"per-layer rows {SB} are not a multiple of batch_size={batch_size}")
    return per_layer.reshape(L, SB // batch_size, batch_size, K).permute(2, 1, 0, 3)


def context_parallel_shard(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """The positions of ``x`` (sequence on ``dim``) that context-parallel rank ``cp_rank`` holds.

    Megatron's load-balanced CP splits the sequence into ``2*cp`` chunks and gives rank ``r``
    chunks ``r`` and ``2*cp - 1 - r`` (causal attention cost then balances).
    """
    if cp_size == 1:
        return x
    S = x.shape[dim]
    if S % (2 * cp_size):
        raise ValueError(f"sequence length {S} must be divisible by 2*cp={2 * cp_size} for context parallel")
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def sequence_parallel_shard(per_layer: torch.Tensor, batch_size: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rows of ``per_layer[L, S*B, K]`` routed on tensor-parallel rank ``tp_rank`` under sequence parallel.

    With sequence parallel each TP rank's router sees ``[S/tp, B, H]``: sequence-major rows
    make that one contiguous block.
    """
    if tp_size == 1:
        return per_layer
    SB = per_layer.shape[1]
    if SB % (batch_size * tp_size):
        raise ValueError(f"{SB // batch_size} positions are not divisible by tp={tp_size} under sequence parallel")
    block = SB // tp_size
    return per_layer[:, tp_rank * block : (tp_rank + 1) * block]


def sequence_parallel_positions(x: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """The positions of ``x[B, S, ...]`` whose routes ``sequence_parallel_shard`` gives rank ``tp_rank``.

    Sequence-major rows ``s*B + b`` cut into ``tp`` contiguous blocks are the positions
    ``[r*S/tp, (r+1)*S/tp)`` of every sample, so ``to_megatron_layout(sequence_parallel_positions(r))``
    equals ``sequence_parallel_shard(to_megatron_layout(r))``. Used to compare what a sequence-parallel
    router dispatched with the routes (and masks) of the positions it saw.
    """
    if tp_size == 1:
        return x
    S = x.shape[1]
    if S % tp_size:
        raise ValueError(f"{S} positions are not divisible by tp={tp_size} under sequence parallel")
    block = S // tp_size
    return x[:, tp_rank * block : (tp_rank + 1) * block]
