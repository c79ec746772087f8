"""The random streams a learner step draws from: capture and restore them, pickle-free.

Owns ``rng_state`` / ``set_rng_state`` (python, numpy, torch CPU/CUDA, the Megatron tracker) and
``portable_rng`` (the subset that carries over to another parallel layout); it writes no file.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker

__all__ = ["portable_rng", "rng_state", "set_rng_state"]


def rng_state() -> dict:
    """Every generator a step may draw from: python, numpy, torch CPU/CUDA, Megatron tracker (pickle-free)."""

    version, internal, gauss = random.getstate()
    state = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": np.random.get_state(legacy=False),  # {'bit_generator', 'state': {'key': uint32[624], 'pos'}, ...}
        "torch_cpu": torch.get_rng_state(),
        "megatron_tracker": dict(get_cuda_rng_tracker().get_states()),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` captured."""

    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    if torch.cuda.is_available() and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"])


def portable_rng(saved: dict) -> dict:
    """Rank 0's process-wide streams, this job's per-rank ones (Megatron tracker, CUDA): for a new layout."""
    current = rng_state()
    return {**saved, "megatron_tracker": current["megatron_tracker"]} | (
        {"torch_cuda": current["torch_cuda"]} if "torch_cuda" in current else {}
    )
