"""What ``moe-rl records inspect`` prints about one records file: sizes, provenance, routes, masks, versions, turns."""

from __future__ import annotations

import numpy as np

from moe_rl.records.batch import RolloutBatch
from moe_rl.records.fingerprint import fingerprint_id
from moe_rl.records.trajectory import turn_summary
from moe_rl.records.versions import token_version_summary

__all__ = ["batch_summary"]


def batch_summary(batch: RolloutBatch) -> dict:
    """Numbers for ``moe-rl records inspect``."""
    out = {
        "format_version": batch.format_version,  # 1-2: one whole-file read; 3: a digest per chunk, read per rank
        "samples": len(batch),
        "prompt_tokens": int(batch.prompt_lens.sum()),
        "response_tokens": int(batch.response_lens.sum()),
        "mean_reward": float(batch.rewards.mean()) if len(batch) else 0.0,
        "weight_versions": sorted(set(batch.weight_versions)),
        **token_version_summary(batch),
        "run_id": batch.run_id,  # the producing run; None in records from before fingerprints
        "fingerprint": batch.fingerprint,
        **turn_summary(batch),  # multi-turn trajectories (format 4): turns, environment tokens, sample 0's turns
    }
    if batch.fingerprint is not None:
        out["fingerprint_id"] = fingerprint_id(batch.fingerprint)
    if batch.routes is not None:
        out.update(
            route_rows=int(batch.routes.shape[0]),
            moe_layers=int(batch.routes.shape[1]),
            top_k=int(batch.routes.shape[2]),
            num_experts=batch.num_experts,
            route_dtype=str(batch.routes.dtype),
            bytes_per_route_entry=batch.routes.dtype.itemsize,
            route_bytes=int(batch.routes.nbytes),
            route_bytes_int32_wire=int(batch.routes.size * 4),
        )
    if batch.mask_offsets is not None:
        sizes = np.diff(batch.mask_offsets)
        sizes = sizes if batch.role_mask is None else sizes[batch.role_mask.astype(bool)]  # generated tokens only
        out.update(mask_size_mean=float(sizes.mean()), mask_size_min=int(sizes.min()), mask_size_max=int(sizes.max()))
    return out
