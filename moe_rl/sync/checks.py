"""What a weight sync checks before anything is sent, and the half-updated servers it refuses.

Owns ``ServerInvalidError``, the served model's ``{name: shape}`` read from an HF checkpoint's headers, the
name / shape / finiteness check of an export (SGLang ignores unknown names and crashes on a wrong shape, so this
is the only place such an export is caught), and the FP8 fake quantisation both sync paths apply.
``WeightSyncError`` and ``is_local_address`` are ``transport``'s.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from moe_rl.sync.quantize import QUANTIZED_SUFFIXES, fake_quantize
from moe_rl.sync.transport import WeightSyncError

__all__ = [
    "ServerInvalidError",
    "check_servable",
    "check_shapes",
    "check_weights",
    "plan_digest",
    "quantize_state_dict",
    "reference_from_hf_dir",
]


class ServerInvalidError(WeightSyncError):
    """Rollouts were asked of a server whose weights are half-updated; a full sync must come first."""


def check_servable(invalid: Mapping[str, str], addresses) -> None:
    """Raise ServerInvalidError if a failed sync left any of ``addresses`` half-updated (``invalid``: address -> why)."""
    bad = {a: why for a, why in invalid.items() if a in {x.rstrip("/") for x in addresses}}
    if bad:
        raise ServerInvalidError(
            f"refusing rollouts from {sorted(bad)}: a failed weight sync left them half-updated "
            f"({'; '.join(bad.values())}); run a full sync first"
        )


def reference_from_hf_dir(hf_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of an HF safetensors checkpoint, read from the file headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    if not shapes:
        raise FileNotFoundError(f"{hf_dir} holds no *.safetensors weights")
    return shapes


def check_shapes(shapes: Mapping[str, tuple[int, ...]], reference: Mapping[str, tuple[int, ...]] | None) -> None:
    """The same names and shapes as ``reference`` (when given); else WeightSyncError.

    SGLang ignores unknown names silently and crashes its scheduler on a wrong shape, so this is
    the only place such an export is caught before it reaches a server.
    """
    if reference is None:
        return
    missing, extra = sorted(set(reference) - set(shapes)), sorted(set(shapes) - set(reference))
    if missing or extra:
        raise WeightSyncError(
            f"weights to sync do not match the served model: {len(missing)} missing (e.g. {missing[:3]}), "
            f"{len(extra)} unknown (e.g. {extra[:3]}); nothing was sent"
        )
    for name, shape in shapes.items():
        if tuple(shape) != tuple(reference[name]):
            raise WeightSyncError(
                f"weights to sync: {name} has shape {tuple(shape)}, the served model has "
                f"{tuple(reference[name])}; nothing was sent"
            )


def plan_digest(shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
    """``(count, sum of a 64-bit hash of every "name:shape")`` of a set of names and shapes: 16 bytes whatever
    the model. The digests of disjoint parts add up to the digest of the whole, so every rank digests its own
    plan and rank 0 compares their sum with the served model's; a missing, extra, renamed or reshaped tensor
    changes it (a duplicate and a missing name do not cancel: their hashes differ)."""
    total = 0
    for name, shape in shapes.items():
        key = f"{name}:{'x'.join(str(int(d)) for d in shape)}".encode()
        total += int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return len(shapes), total % (1 << 64)


def check_weights(named: Mapping[str, torch.Tensor], reference: Mapping[str, tuple[int, ...]] | None) -> None:
    """Same names and shapes as `reference` (when given) and all values finite; else WeightSyncError."""
    check_shapes({n: tuple(t.shape) for n, t in named.items()}, reference)
    for name, tensor in named.items():
        if tensor.is_floating_point() and not _all_finite(tensor):
            raise WeightSyncError(f"weights to sync: {name} holds NaN or Inf values; nothing was sent")


def _all_finite(tensor: torch.Tensor) -> bool:
    """numpy where it can (single-threaded: torch's OpenMP reductions crawl on an oversubscribed host)."""
    t = tensor.detach().cpu()
    if t.dtype in (torch.float16, torch.float32, torch.float64):
        return bool(np.isfinite(t.numpy()).all())
    return bool(torch.isfinite(t).all())


def quantize_state_dict(named: Mapping[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """FP8 fake quantisation of the projection weights, exactly as `quantize_hf_dir` does on disk."""
    if fmt == "none":
        return dict(named)
    return {k: fake_quantize(v, fmt, 128) if k.endswith(QUANTIZED_SUFFIXES) else v for k, v in named.items()}
