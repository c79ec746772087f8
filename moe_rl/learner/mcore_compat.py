"""Megatron-Core version support (>= 0.16.1, < 0.20) and the fixes that apply on every device.

Owns the version check and the release-specific patches that are not about the CPU (those live in
``moe_rl.learner.cpu_shims``). Each patch is guarded by a probe of the failure it prevents, so on a
release that fixed it the patch is a no-op.

Patches (name -> failure prevented):
  te_general_gemm   0.16.x without Transformer Engine: ``NameError: name 'te_general_gemm' is not
                    defined`` in ``router_gating_linear`` (moe_utils.py imports the name only inside
                    ``try: from ...transformer_engine import ...`` but tests ``te_general_gemm is not
                    None`` unconditionally). Seen on CPU and on an H100 (no TE); 0.17+ binds it to None.
  expert_bias_padding_mask  0.16.1: ``TopKRouter._apply_expert_bias`` computes
                    ``routing_map[N, E] & ~padding_mask[N]``, a broadcast error as soon as a padding mask
                    reaches a router with an expert bias (tests/learner/test_expert_bias.py).

Wrapper (not a patch): ``pipeline_schedule()`` returns Megatron's ``get_forward_backward_func()``
for this job; on a machine without CUDA it runs the schedule under ``_HostDevice``, because every
schedule of 0.16.1 allocates ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")``
(pipeline_parallel/schedules.py, forward_backward_no_pipelining / _with_interleaving /
_without_interleaving), a ``RuntimeError``/``AssertionError: Torch not compiled with CUDA enabled``
on CPU. The mode maps only an explicit ``device="cuda"`` to the host, only inside the call.

Wrapper (not a patch): ``megatron_optimizer_device()`` is the context in which moe_rl builds Megatron's
DDP and optimizer and calls ``optimizer.step()``. The distributed optimizer of 0.16.1 hard-codes CUDA:
``distrib_optimizer.py`` (~361/420/582) refuses a param whose ``param.type()`` is not a ``torch.cuda.*``
type, ``optimizer.py`` (~473/481/485) and ``clip_grads.py`` (~90/103/115/207) allocate with
``device='cuda'``. Without CUDA the context makes host tensors report their ``torch.cuda.*`` type name
and creates explicit-``cuda`` tensors on the host, only inside those calls; with CUDA it does nothing.

API differences, read in the 0.16.1, 0.17.0, 0.18.0 and 0.19.2 sources (docs/gpu.md lists them):
``RouterReplay.get_replay_topk`` keeps its signature and call site throughout; 0.17 adds static
CUDA-graph buffers and 0.19 a ``layer_number`` (both unused by moe_rl); 0.19's
``quantile_balancing`` routing type bypasses the replay hook (rejected by
``moe_rl.replay.binding.unsupported_router_options``); the DDP / optimizer config fields moe_rl sets
exist unchanged in all four.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from megatron.core import package_info
from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from torch.overrides import TorchFunctionMode

__all__ = [
    "SUPPORTED",
    "apply_megatron_fixes",
    "bind_te_general_gemm",
    "check_megatron_core_version",
    "megatron_core_version",
    "need_te_general_gemm",
    "pipeline_schedule",
    "schedule_needs_host_device",
]

SUPPORTED = ((0, 16, 1), (0, 20, 0))
"""Supported megatron-core releases: ``SUPPORTED[0] <= version < SUPPORTED[1]``."""


def megatron_core_version() -> tuple[int, int, int]:
    """Imported megatron-core release as ``(major, minor, patch)``, from ``megatron.core.package_info``
    (also right for a source checkout on ``PYTHONPATH``, which has no package metadata)."""

    return tuple(int(x) for x in (package_info.MAJOR, package_info.MINOR, package_info.PATCH))


def check_megatron_core_version(version: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """Return the installed version; ``RuntimeError`` naming the supported range if it is outside it."""
    version = megatron_core_version() if version is None else version
    lo, hi = SUPPORTED
    if not lo <= tuple(version) < hi:
        have = ".".join(map(str, version))
        raise RuntimeError(
            f"megatron-core {have} is installed; moe_rl supports megatron-core >= {'.'.join(map(str, lo))}, "
            f"< {'.'.join(map(str, hi[:2]))} (pip install 'megatron-core>=0.16.1,<0.20')"
        )
    return tuple(version)


def need_te_general_gemm() -> bool:
    """True when ``router_gating_linear`` would hit an unbound ``te_general_gemm`` (0.16.x, no TE)."""

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    try:
        return "te_general_gemm is not None" in inspect.getsource(moe_utils)
    except (OSError, TypeError):
        return False


def bind_te_general_gemm() -> None:
    """Bind the missing name to None: the router then takes its plain torch matmul branch."""

    moe_utils.te_general_gemm = None


def _expert_bias_counts_valid_tokens(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """``TopKRouter._apply_expert_bias`` with the pad mask broadcast over experts.

    megatron-core 0.16.1 computes ``routing_map[N, E] & ~padding_mask[N]``, which cannot broadcast
    (a RuntimeError as soon as a padding mask reaches a router with ``moe_router_enable_expert_bias``);
    the intent — count only non-pad tokens per expert — needs ``padding_mask[:, None]``.
    """
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1).bool()
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def need_expert_bias_fix() -> bool:
    """megatron-core 0.16.1: ``TopKRouter._apply_expert_bias`` cannot broadcast its pad mask."""

    method = TopKRouter._apply_expert_bias
    if method is _expert_bias_counts_valid_tokens:
        return False
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    return "routing_map & (~padding_mask)" in source


def fix_expert_bias() -> None:
    TopKRouter._apply_expert_bias = _expert_bias_counts_valid_tokens


_FIXES = {
    "te_general_gemm": (need_te_general_gemm, bind_te_general_gemm),
    "expert_bias_padding_mask": (need_expert_bias_fix, fix_expert_bias),
}


def apply_megatron_fixes() -> list[str]:
    """Check the version and apply every fix whose probe fires (any device); return the names applied.

    Idempotent: a fix applied once no longer probes as needed.
    """
    check_megatron_core_version()
    applied = []
    for name, (needed, apply) in _FIXES.items():
        if needed():
            apply()
            applied.append(name)
    return applied


class _HostDevice(TorchFunctionMode):
    """Inside the context, tensors created with an explicit ``device="cuda"`` are created on the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


class _HostCudaTypes(_HostDevice):
    """``_HostDevice``, and ``tensor.type()`` of a host tensor reads as its ``torch.cuda.*`` name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if args[0].is_cuda else name.replace("torch.", "torch.cuda.", 1)
        return super().__torch_function__(func, types, args, kwargs)


@functools.cache
def optimizer_needs_host_device() -> bool:
    """True when Megatron's distributed optimizer / DDP path hard-codes CUDA and this machine has none.

    0.16.1 (read in the sources): ``distrib_optimizer.py`` accepts only params whose ``param.type()`` is a
    ``torch.cuda.*Tensor`` (``_build_model_and_main_param_groups``, ``__init__``); ``optimizer.py`` allocates
    ``found_inf`` / ``_dummy_overflow_buf`` / ``_scale_one`` with ``device='cuda'`` (``MixedPrecisionOptimizer``);
    ``clip_grads.py`` allocates its norm and overflow buffers with ``device='cuda'``.
    """
    if torch.cuda.is_available():
        return False

    return (
        "'torch.cuda.FloatTensor'" in inspect.getsource(distrib_optimizer)
        or "device='cuda'" in inspect.getsource(optimizer)
        or "device='cuda'" in inspect.getsource(clip_grads)
    )


def megatron_optimizer_device():
    """Context for building and stepping Megatron's DDP / optimizer on this machine: on a host without
    CUDA (and a release that hard-codes it) explicit ``device="cuda"`` tensors are created on the host and
    host tensors report ``torch.cuda.*`` types, only inside the call; elsewhere a no-op."""

    return _HostCudaTypes() if optimizer_needs_host_device() else contextlib.nullcontext()


def schedule_needs_host_device(schedule) -> bool:
    """True when ``schedule`` hard-codes a CUDA tensor and this machine has no CUDA."""
    if torch.cuda.is_available():
        return False
    target = getattr(schedule, "func", schedule)  # functools.partial in some releases
    try:
        return 'device="cuda"' in inspect.getsource(target)
    except (OSError, TypeError):
        return False


def pipeline_schedule():
    """Megatron's forward-backward schedule for this job's pp / vpp sizes, runnable on this machine."""

    schedule = get_forward_backward_func()
    if not schedule_needs_host_device(schedule):
        return schedule

    @functools.wraps(schedule)
    def on_host(*args, **kwargs):
        with _HostDevice():
            return schedule(*args, **kwargs)

    return on_host
