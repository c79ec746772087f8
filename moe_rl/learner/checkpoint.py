"""Learner checkpoints: save / resume model + optimizer + RNG + step, atomically.

Owns the on-disk layout ``<dir>/step_<N>/rank_<r>.pt`` (+ ``meta.json``) and the
``<dir>/latest`` pointer. Each rank saves its own shard (its experts under ep > 1),
so a checkpoint resumes on the same parallel layout. A checkpoint becomes visible
only when complete: shards go to a temp dir that rank 0 renames, then ``latest``
is replaced. On CPU resume reproduces the next step bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["save_checkpoint", "load_checkpoint", "latest_step", "rng_state", "set_rng_state"]

FORMAT_VERSION = 1


def rng_state() -> dict:
    """Every generator a step may draw from: python, numpy, torch CPU/CUDA, Megatron tracker."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "megatron_tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` captured."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    if torch.cuda.is_available() and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"])


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def latest_step(ckpt_dir: str | Path) -> int | None:
    """Step of the newest complete checkpoint under ``ckpt_dir`` (None if there is none)."""
    pointer = Path(ckpt_dir) / "latest"
    if not pointer.exists():
        return None
    return int(pointer.read_text().strip())


def _step_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step_{step:08d}"


def save_checkpoint(learner, ckpt_dir: str | Path, keep_last: int = 2, extra: dict | None = None) -> Path:
    """Save ``learner`` (collective: every rank calls it); returns the step directory.

    ``extra`` (JSON-serialisable, e.g. the trainer's data cursor) goes in ``meta.json``.
    Older checkpoints beyond ``keep_last`` are deleted after the new one is visible.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1; got {keep_last}")
    ckpt_dir = Path(ckpt_dir)
    rank, world = _rank_world()
    step = learner.step
    final = _step_dir(ckpt_dir, step)
    tmp = ckpt_dir / f".step_{step:08d}.tmp"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir()
    _barrier()
    shard = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "model": learner.module.state_dict(),
        "optimizer": learner.optimizer.state_dict(),
        "rng": rng_state(),
    }
    torch.save(shard, tmp / f"rank_{rank:05d}.pt")
    _barrier()
    if rank == 0:
        p = learner.cfg.parallel
        meta = {"format_version": FORMAT_VERSION, "step": step, "world_size": world,
                "parallel": {"tp": p.tp, "pp": p.pp, "ep": p.ep, "cp": p.cp, "etp": p.etp}, "extra": extra or {}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(ckpt_dir / "latest", f"{step}\n")
        steps = sorted(int(d.name[5:]) for d in ckpt_dir.glob("step_*") if d.name[5:].isdigit())
        for old in steps[:-keep_last]:
            shutil.rmtree(_step_dir(ckpt_dir, old), ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(learner, ckpt_dir: str | Path, step: int | None = None) -> dict | None:
    """Restore ``learner`` from ``step`` (default: latest); returns ``meta`` or None if none exists."""
    ckpt_dir = Path(ckpt_dir)
    step = latest_step(ckpt_dir) if step is None else step
    if step is None:
        return None
    d = _step_dir(ckpt_dir, step)
    meta = json.loads((d / "meta.json").read_text())
    rank, world = _rank_world()
    if meta["world_size"] != world:
        raise ValueError(f"{d} was saved by {meta['world_size']} ranks (parallel={meta['parallel']}); "
                         f"this job has {world}; expected the same layout")
    shard = torch.load(d / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)
    learner.module.load_state_dict(shard["model"], strict=True)
    learner.optimizer.load_state_dict(shard["optimizer"])
    set_rng_state(shard["rng"])
    learner.step = shard["step"]
    return meta
