"""Checks of the per-rank HF import (``hf_import.load_hf_weights``) shared by the 1-rank test and the 2-rank
workers (ep=2 in ``tests/distributed/ep_parity_worker.py``, pp=2 in ``tests/train/pp_worker.py``).

The oracle is the import as it was before issue 52: load every file into one dict, convert the whole model
(``hf_to_megatron``: gate/up concatenated, qkv packed) and slice this rank's part (``tp_slice``).
"""

from __future__ import annotations

import torch

from moe_rl.learner.hf_convert import hf_to_megatron, read_hf_state_dict
from moe_rl.learner.hf_import import load_hf_weights
from moe_rl.learner.model import unwrap
from moe_rl.learner.ownership import global_name, local_expert_range, stage_layer_offset, tp_rank_and_size
from moe_rl.learner.tp_shards import tp_slice


def whole_dict_import(model, hf_dir, model_cfg) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The former import's tensors ``{local name: tensor in the model's dtype}`` and this rank's own bytes
    (``{local name: bytes of its part in the file's dtype}``)."""
    full = hf_to_megatron(read_hf_state_dict(hf_dir), model_cfg)
    start, _ = local_expert_range(model)
    offset = stage_layer_offset(model)
    out, own = {}, {}
    for name, tensor in unwrap(model).state_dict().items():
        src = global_name(name, start, offset)
        if src in full:
            shard = tp_slice(src, full[src], *tp_rank_and_size(src))
            out[name] = shard.to(tensor.dtype)
            own[name] = shard.numel() * shard.element_size()
    return out, own


def check_rank_import(model, hf_dir, model_cfg) -> dict:
    """Import ``hf_dir`` per rank into ``model``; compare with the oracle; report the reader's byte counts."""
    stats = load_hf_weights(model, hf_dir, model_cfg)
    got = unwrap(model).state_dict()
    want, own = whole_dict_import(model, hf_dir, model_cfg)
    hf = read_hf_state_dict(hf_dir)
    return {
        "bitwise_equal": bool(want) and all(torch.equal(got[n], t) for n, t in want.items()),
        "num_tensors": len(want),
        "bytes_read": stats.total_bytes,
        "bytes_by_file": stats.bytes_by_file,
        "own_bytes": sum(own.values()),
        "largest_tensor_bytes": max(t.numel() * t.element_size() for t in hf.values()),
        "checkpoint_bytes": sum(t.numel() * t.element_size() for t in hf.values()),
        "reads": [list(r) for r in stats.reads],
        "shapes": {n: list(t.shape) for n, t in hf.items()},
    }


def uncovered(reports: list[dict]) -> list[str]:
    """HF tensors with an element no rank read (from each report's ``reads``)."""
    shapes = reports[0]["shapes"]
    masks = {n: torch.zeros(s, dtype=torch.bool) for n, s in shapes.items()}
    for r in reports:
        for name, dim, start, stop in r["reads"]:
            if dim is None:
                masks[name][...] = True
            else:
                masks[name].narrow(dim, start, stop - start)[...] = True
    return sorted(n for n, m in masks.items() if not m.all())


def bytes_problems(reports: list[dict]) -> list[str]:
    """Ranks that read more than their own share plus the largest tensor, or whose files' counts do not add up."""
    out = []
    for rank, r in enumerate(reports):
        if r["bytes_read"] > r["own_bytes"] + r["largest_tensor_bytes"]:
            out.append(
                f"rank {rank} read {r['bytes_read']} B > own {r['own_bytes']} + largest {r['largest_tensor_bytes']}"
            )
        if sum(r["bytes_by_file"].values()) != r["bytes_read"]:
            out.append(f"rank {rank}: per-file counts {r['bytes_by_file']} do not add up to {r['bytes_read']}")
    return out
