"""CPU support for Megatron-Core 0.16: the minimal set of runtime shims.

Owns every patch moe_rl applies to Megatron-Core / torch so that the *same*
Megatron model code runs on a machine without a GPU (tests, the tiny demo).
Nothing here runs when CUDA is available. Each shim is guarded by a probe of
the failure it prevents, so on a release that fixed the problem it is a no-op.
Measured obstacles: /work/shared/notes/megatron-core-on-cpu.md.

Shims (name -> failure prevented):
  cuda_current_device   ``AssertionError: Torch not compiled with CUDA`` from
                        ``torch.cuda.current_device()`` in RoPE ``get_emb`` and
                        ``Router.gating`` (they move CPU params "to the GPU").
  te_general_gemm       ``NameError: te_general_gemm`` in the router GEMM when
                        Transformer Engine is absent (0.16.x; also on a GPU, so
                        ``mcore_compat.apply_megatron_fixes`` applies it there).
  dispatcher_stream     ``torch.cuda.Stream requires CUDA`` when the alltoall
                        token dispatcher creates its device->host side stream.
  split_sizes_numpy     ``all_to_all_single(): incompatible function arguments``:
                        ``maybe_move_tensor_to_cpu(as_numpy=True)`` leaves CPU
                        split sizes as tensors.
  cuda_rng_state        ``Torch not compiled with CUDA`` from
                        ``_get/_set_cuda_rng_state`` in activation recompute and
                        the RNG tracker's ``fork``.
  cuda_synchronize      ``AssertionError: Torch not compiled with CUDA enabled`` from
                        ``torch.cuda.synchronize()``, which pipeline parallelism's
                        ``P2PCommunicator._communicate_shapes`` calls unconditionally
                        (p2p_communication.py, ``variable_seq_lengths=True``: ragged
                        microbatches). Host ops are already ordered: a no-op.

The RNG tracker itself needs no patch, only a different call: see
``seed_model_parallel_rng``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.pipeline_parallel import p2p_communication
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.moe import router, token_dispatcher
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from moe_rl.learner.mcore_compat import bind_te_general_gemm as _apply_te_general_gemm
from moe_rl.learner.mcore_compat import need_te_general_gemm as _need_te_general_gemm

__all__ = ["CPU_SHIMS", "applied_shims", "apply_cpu_shims", "seed_model_parallel_rng"]


class _HostEvent:
    """Stand-in for ``torch.cuda.Event``: on the host every op has already happened."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True


class _HostStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU: host ops are already ordered."""

    device = torch.device("cpu")

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        return _HostEvent() if event is None else event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_HOST_STREAM = _HostStream()


def _source_mentions(obj, needle: str) -> bool:
    try:
        return needle in inspect.getsource(obj)
    except (OSError, TypeError):
        return False


def _raises(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except Exception:  # noqa: BLE001 - any failure means the shim is needed
        return True
    return False


# --- cuda_current_device ---------------------------------------------------


def _need_current_device() -> bool:
    calls = _source_mentions(rotary_pos_embedding, "torch.cuda.current_device()") or (
        _source_mentions(router, "torch.cuda.current_device()")
    )
    return calls and _raises(torch.cuda.current_device)


def _apply_current_device() -> None:
    # On a CPU-only build this function can only raise, so redirecting Megatron's
    # "move to the current GPU" to the host device changes no working behaviour.
    torch.cuda.current_device = lambda: "cpu"


# --- te_general_gemm ---------------------------------------------------------
# Not CPU-specific (a GPU without Transformer Engine hits it too): ``moe_rl.learner.mcore_compat``
# owns it and applies it on every device; it stays listed here so the CPU set is complete.


# --- dispatcher_stream -------------------------------------------------------


def _need_dispatcher_stream() -> bool:
    return getattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _HOST_STREAM) is None and _raises(torch.cuda.Stream)


def _apply_dispatcher_stream() -> None:
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _HOST_STREAM
    # The dispatcher compares the current stream with its side stream; returning
    # the same stand-in makes it take the "not on a side stream" branch.
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM


# --- split_sizes_numpy -------------------------------------------------------


def _need_split_sizes_numpy() -> bool:
    move = getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None)
    if move is None or getattr(move, "_moe_rl_shim", False):
        return False
    return torch.is_tensor(move(torch.tensor([1, 2], device="cpu"), as_numpy=True))


def _apply_split_sizes_numpy() -> None:
    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        out = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        # torch.distributed.all_to_all_single wants python/numpy split sizes.
        if as_numpy and torch.is_tensor(out):
            return out.cpu().numpy()
        return out

    maybe_move_tensor_to_cpu._moe_rl_shim = True
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# --- cuda_rng_state ----------------------------------------------------------

_EMPTY_RNG_STATE = torch.zeros(0, dtype=torch.uint8, device="cpu")


def _need_cuda_rng_state() -> bool:
    return _raises(tp_random._get_cuda_rng_state)


def _apply_cuda_rng_state() -> None:

    # There is no device generator on CPU; the CPU generator state is saved and
    # restored separately by the recompute code (``torch.get_rng_state``).
    tp_random._get_cuda_rng_state = lambda *a, **k: _EMPTY_RNG_STATE
    tp_random._set_cuda_rng_state = lambda *a, **k: None


# --- cuda_synchronize ----------------------------------------------------------


def _need_cuda_synchronize() -> bool:
    return _source_mentions(p2p_communication, "torch.cuda.synchronize()") and _raises(torch.cuda.synchronize)


def _apply_cuda_synchronize() -> None:
    torch.cuda.synchronize = lambda device=None: None


CPU_SHIMS: dict[str, tuple[Callable[[], bool], Callable[[], None]]] = {
    "cuda_current_device": (_need_current_device, _apply_current_device),
    "te_general_gemm": (_need_te_general_gemm, _apply_te_general_gemm),
    "dispatcher_stream": (_need_dispatcher_stream, _apply_dispatcher_stream),
    "split_sizes_numpy": (_need_split_sizes_numpy, _apply_split_sizes_numpy),
    "cuda_rng_state": (_need_cuda_rng_state, _apply_cuda_rng_state),
    "cuda_synchronize": (_need_cuda_synchronize, _apply_cuda_synchronize),
}

_APPLIED: list[str] = []


def apply_cpu_shims(only: tuple[str, ...] | None = None) -> list[str]:
    """Apply the CPU shims whose failure probe fires; return the names applied.

    A no-op when CUDA is available. Idempotent: a shim already applied is not
    applied again (its probe no longer fires). ``only`` restricts the set (tests).
    """
    if torch.cuda.is_available():
        return []
    names = CPU_SHIMS if only is None else only
    unknown = set(names) - set(CPU_SHIMS)
    if unknown:
        raise ValueError(f"unknown CPU shim(s) {sorted(unknown)}; expected names from {list(CPU_SHIMS)}")
    for name in names:
        needed, apply = CPU_SHIMS[name]
        if name not in _APPLIED and needed():
            apply()
            _APPLIED.append(name)
    return list(_APPLIED)


def applied_shims() -> list[str]:
    """Names of the shims applied in this process, in application order."""
    return list(_APPLIED)


def seed_model_parallel_rng(seed: int) -> None:
    """Seed Megatron's model-parallel RNG tracker (tp / ep / etp streams).

    On GPU this is Megatron's ``model_parallel_cuda_manual_seed``. On CPU the
    default tracker stores CUDA generator states it cannot create; the
    "inference" tracker forks the CPU generator instead, which is what dropout
    and init then draw from.
    """

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
