"""Data-parallel exchanges of the training loop: who this rank is, and gathering response rows.

Owns the only collectives the loop issues itself (Megatron's DDP and ``finalize_model_grads``
reduce the gradients): an all-gather of per-sample rows over the data-parallel group, so every
rank sees a whole minibatch exactly as a single rank would, and the maximum over ranks of the bytes
each read of the step's records (one number).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

__all__ = ["all_gather_rows", "barrier", "dp_group", "dp_rank_and_size", "is_main_process", "records_read_metrics"]


def dp_group():
    """Megatron's data-parallel group (None when Megatron is not initialised)."""

    return ps.get_data_parallel_group() if ps.model_parallel_is_initialized() else None


def dp_rank_and_size() -> tuple[int, int]:
    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def all_gather_rows(x: torch.Tensor, group=None) -> torch.Tensor:
    """``x[n, ...]`` on every data-parallel rank -> ``[dp * n, ...]`` in rank order (same ``n`` everywhere)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def records_read_metrics(read, device) -> dict[str, float]:
    """``records/read_bytes_max`` (the most bytes any rank read of the step's records file: its share, the
    header and the shared arrays) and ``records/file_bytes``; ``read`` is ``StepRecords.last_read``."""
    if read is None:
        return {}
    most = torch.tensor([float(read.bytes_read)], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(most, op=dist.ReduceOp.MAX)  # size: one number
    return {"records/read_bytes_max": float(most[0]), "records/file_bytes": float(read.file_bytes)}
