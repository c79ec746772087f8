"""A data-parallel rank's share of a records file: only the bytes of the samples it trains on.

Owns ``load_share``: the header, the per-sample and shared per-token arrays, and the token rows of the
given samples (``chunks.RecordsFile``), each chunk checked against its digest, as one ``RolloutBatch``
holding those samples (``held``). Files of formats 1-2 carry no chunk digests: they are read whole, as
before (``RolloutBatch.load``, whose whole-file sha256 is then their identity).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_rl.records.batch import RolloutBatch, parse_meta, unreadable
from moe_rl.records.chunks import SHARED, RecordMismatch, RecordsFile
from moe_rl.records.routes import RecordError
from moe_rl.records.trajectory import TRAJECTORY_ARRAYS

__all__ = ["SharedRead", "load_share"]


@dataclass
class SharedRead:
    """What ``load_share`` read: the batch, the bytes it read from the file and the file's size."""

    batch: RolloutBatch
    bytes_read: int
    file_bytes: int


def load_share(
    path: str | Path, ids=None, sha256: str | None = None, num_samples: int | None = None, shared=SHARED
) -> SharedRead:
    """Samples ``ids`` (all when None) of ``path``, checked: every chunk read against its digest, the batch's
    structure (``validate``); ``sha256``: the identity rank 0 found (else ``RecordMismatch``); ``num_samples``:
    the count the caller's plan expects; ``shared``: the per-token arrays every rank reads (format 3: one left
    out is None in the batch, e.g. ``rollout_logp`` where Keep Sampling Mask trains on ``sampling_logp``; a
    trajectory's ``role_mask`` / ``loss_mask`` / ``turn_ids`` are always read: they decide what trains).
    Any problem is one ``RecordError`` naming ``path``."""
    path = Path(path)
    try:
        with RecordsFile(path) as f:
            meta = parse_meta(f.metadata)
            if meta["format_version"] < 3:
                f.bytes_read += f.size  # read whole below
                batch = RolloutBatch.load(path, sha256)
                _check_count(batch, num_samples)
                return SharedRead(batch, f.bytes_read, f.size)
            if sha256 is not None and f.identity != sha256:
                raise RecordMismatch(f"content has sha256 {f.identity[:16]}..., expected {sha256[:16]}...")
            names = tuple(dict.fromkeys((*shared, *TRAJECTORY_ARRAYS)))  # a trajectory's masks: always read
            shared = f.shared(meta, names) | {k: None for k in SHARED if k not in names}
            if "prompt_lens" not in shared or "response_lens" not in shared:
                raise RecordError("missing arrays ['prompt_lens', 'response_lens']")
            n = len(shared["prompt_lens"])
            if num_samples is not None and n != num_samples:
                raise RecordError(_count_message(n, num_samples))
            held = np.arange(n) if ids is None else np.asarray([int(i) for i in ids], np.int64)
            if held.size and (held.min() < 0 or held.max() >= n or np.unique(held).size != held.size):
                raise RecordError(f"the file has {n} samples; the share asked for is not distinct ids in [0, {n})")
            if len(shared["response_lens"]) != n:
                raise RecordError(f"response_lens has {len(shared['response_lens'])} entries; expected {n}")
            local = f.samples(held, shared["prompt_lens"], shared["response_lens"], meta)
            batch = RolloutBatch.from_arrays(shared | local, meta)
            batch.sha256, batch.held = f.identity, None if ids is None else held
            batch.validate()
            return SharedRead(batch, f.bytes_read, f.size)
    except RecordError as exc:
        message = str(exc)
        raise type(exc)(message if message.startswith(f"{path}: ") else f"{path}: {message}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RecordError(f"{path}: {unreadable(exc)}") from None


def _count_message(n: int, expected: int) -> str:
    return f"has {n} samples; the config asks for {expected} (train.prompts_per_step x rollout.samples_per_prompt)"


def _check_count(batch: RolloutBatch, num_samples: int | None) -> None:
    if num_samples is not None and len(batch) != num_samples:
        raise RecordError(_count_message(len(batch), num_samples))
