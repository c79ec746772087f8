"""Layout-free learner state: model tensors and Adam state as global tensors keyed by global names.

Owns the two files a checkpoint (and the reference policy) stores instead of per-rank shards:

* ``model.safetensors``: every parameter and persistent buffer of the ``GPTModel``, tp/etp shards
  concatenated (``tp_shards``) and experts gathered over the ep group under global expert ids,
  named as ``hf_convert.canonical_name`` names them (the names the HF export starts from);
* ``optimizer.safetensors``: for each such parameter ``exp_avg/<name>``, ``exp_avg_sq/<name>``,
  ``step/<name>`` and, for Megatron's mixed-precision optimizer (GPU, bf16), its fp32 master copy
  ``main/<name>``.

Saving is collective over the tp/etp/ep groups and rank 0 writes (the full state passes through
rank 0's memory: fine at CPU scale, not a fully parallel save); loading is local: each rank reads
the global tensors it holds a part of and slices its shard for the current (tp, etp, ep) layout,
so a checkpoint resumes on any (tp, etp, ep) layout. dp replicas need nothing. Under pipeline
parallelism names carry global layer numbers (``hf_convert.globalise_layer``), saving gathers every
stage's tensors to rank 0 (``hf_convert.gather_stages``) and each stage loads its own layers; the pp
size itself may change between save and load as long as the stages stay equal. Files are safetensors (JSON header, raw tensors): reading never unpickles.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moe_rl.learner.hf_convert import (
    _expert_slot, _local_expert_range, _tp_rank_and_size, canonical_name, gather_stages, globalise_layer,
    stage_layer_offset,
)  # fmt: skip
from moe_rl.learner.model import unwrap
from moe_rl.learner.tp_shards import gather_tp_shards, tp_slice

__all__ = [
    "GlobalStateError", "model_tensors", "gather_global", "save_global_model", "load_global_model",
    "save_global_optimizer", "load_global_optimizer", "check_global_file", "param_state",
]  # fmt: skip

MODEL_FORMAT, OPTIMIZER_FORMAT = "moe_rl.global_model/1", "moe_rl.global_optimizer/1"
_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


class GlobalStateError(ValueError):
    """A global state file is unreadable, or does not fit the model (names or shapes differ)."""


def model_tensors(model) -> dict[str, torch.Tensor]:
    """The bare model's parameters and persistent buffers by state-dict name (``_extra_state`` left out)."""
    m = unwrap(model)
    return {k: v for k, v in m.state_dict(keep_vars=True).items() if torch.is_tensor(v) and not k.endswith("_extra_state")}


def _global_name(local: str, expert_start: int, layer_offset: int = 0) -> str:
    name = globalise_layer(canonical_name(local), layer_offset)
    slot = _expert_slot(name)
    return name if slot is None else f"{slot[0]}{expert_start + slot[1]}.{slot[2]}"


def gather_global(model, local: Mapping[str, torch.Tensor], split: bool = True) -> dict[str, torch.Tensor]:
    """``{state-dict name: this rank's tensor}`` -> ``{global name: full CPU tensor}`` (collective).

    Every rank of the tp, etp and ep groups calls it with the same names. ``split=False`` for
    tensors that are not sharded along the parameter's tp dim (e.g. Adam's per-parameter step):
    they are taken as they are on each tp rank and only gathered over the experts.
    """
    from megatron.core import parallel_state as ps

    local = {canonical_name(n): t.detach() for n, t in local.items()}
    if split and (ps.get_tensor_model_parallel_world_size() > 1 or ps.get_expert_tensor_parallel_world_size() > 1):
        local = gather_tp_shards(local, ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group())
    start, num_local = _local_expert_range(model)
    ep = ps.get_expert_model_parallel_world_size()
    out: dict[str, torch.Tensor] = {}
    for name in sorted(local):
        t, slot = local[name], _expert_slot(name)
        if slot is None or ep == 1:
            out[_global_name(name, start)] = t.cpu().clone()
            continue
        gathered = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(gathered, t.contiguous(), group=ps.get_expert_model_parallel_group())
        for r, g in enumerate(gathered):
            out[f"{slot[0]}{r * num_local + slot[1]}.{slot[2]}"] = g.cpu()
    offset = stage_layer_offset(model)  # pp > 1: this stage's layers under their global numbers
    return {globalise_layer(k, offset): v for k, v in out.items()}


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _write(tensors: dict[str, torch.Tensor], path: Path, fmt: str) -> None:
    """Rank 0 writes ``tensors`` to ``path`` (via a temp name, then renamed); OSError propagates."""
    import os
    import re

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": fmt})
    except SafetensorError as exc:  # the Rust writer reports I/O failures as "... (os error N)"
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
    os.replace(tmp, path)


def check_global_file(path: str | Path, fmt: str) -> None:
    """GlobalStateError unless ``path`` is a readable safetensors file written with format ``fmt``."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            got = (fh.metadata() or {}).get("format")
    except (SafetensorError, OSError) as exc:
        raise GlobalStateError(f"{path} is missing or not a readable safetensors file ({exc})") from None
    if got != fmt:
        raise GlobalStateError(f"{path} has format {got!r}; expected {fmt!r}")


class _Reader:
    """Reads global tensors from one file and slices this rank's shard of each."""

    def __init__(self, path: Path, fmt: str):
        check_global_file(path, fmt)
        self.path = path
        self.fh = safe_open(str(path), framework="pt", device="cpu")
        self.keys = set(self.fh.keys())

    def shard(self, key: str, global_name: str, like: torch.Tensor, split: bool = True) -> torch.Tensor:
        if key not in self.keys:
            raise GlobalStateError(f"{self.path} lacks {key!r}; expected the same model config (names differ)")
        full = self.fh.get_tensor(key)
        part = tp_slice(global_name, full, *_tp_rank_and_size(global_name)) if split else full
        if part.shape != like.shape:
            on_rank = f" ({tuple(part.shape)} on this rank)" if part.shape != full.shape else ""
            raise GlobalStateError(f"{self.path}: size mismatch for {key}: saved {tuple(full.shape)}{on_rank}, the "
                                   f"model expects {tuple(like.shape)}; the model config differs")  # fmt: skip
        return part


def save_global_model(model, path: str | Path) -> None:
    """Gather ``model`` (collective over tp/etp/ep) and write it on rank 0 as ``path``."""
    full = gather_stages(gather_global(model, model_tensors(model)))
    if full is not None and _is_writer():
        _write(full, Path(path), MODEL_FORMAT)


def load_global_model(model, path: str | Path) -> None:
    """Copy this rank's shard of every tensor in ``path`` into ``model`` (local; every tensor required)."""
    reader = _Reader(Path(path), MODEL_FORMAT)
    start, _ = _local_expert_range(model)
    offset = stage_layer_offset(model)
    with torch.no_grad():
        for name, tensor in model_tensors(model).items():
            g = _global_name(name, start, offset)
            tensor.copy_(reader.shard(g, g, tensor))


# ------------------------------------------------------------------------------------- optimizer
def _param_slots(optimizer) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.optim.Optimizer]]:
    """``(model param, param the optimizer updates, torch optimizer holding its state)`` per parameter.

    torch optimizers (the CPU learner) update the model params; Megatron's mixed-precision
    optimizer (GPU) updates fp32 master copies; ``ChainedOptimizer`` / ``FP32Optimizer`` wrap those.
    """
    if optimizer is None:  # Megatron's stub optimizer of a rank without parameters in that chain
        return
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                yield p, p, optimizer
    elif hasattr(optimizer, "chained_optimizers"):
        for opt in optimizer.chained_optimizers:
            yield from _param_slots(opt)
    elif hasattr(optimizer, "fp32_from_float16_groups"):
        for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups, strict=True):
            for p, main in zip(model_group, main_group, strict=True):
                yield p, main, optimizer.optimizer
        for group in optimizer.fp32_from_fp32_groups:
            for p in group:
                yield p, p, optimizer.optimizer
    elif hasattr(optimizer, "optimizer"):
        yield from _param_slots(optimizer.optimizer)
    else:
        raise GlobalStateError(f"cannot read the state of a {type(optimizer).__name__} optimizer; expected a "
                               "torch optimizer or Megatron's (Chained/Float16/FP32) optimizer")  # fmt: skip


def param_state(optimizer, param) -> dict:
    """The Adam state (``exp_avg``, ``exp_avg_sq``, ``step``) the optimizer keeps for model parameter ``param``."""
    for p, main, opt in _param_slots(optimizer):
        if p is param:
            return opt.state.get(main, {})
    raise KeyError("the optimizer does not update this parameter")


def _named_slots(optimizer, model):
    names = {id(t): n for n, t in model_tensors(model).items()}
    for p, main, opt in _param_slots(optimizer):
        if id(p) not in names:
            raise GlobalStateError("the optimizer updates a tensor that is not a parameter of the model")
        yield names[id(p)], p, main, opt


def save_global_optimizer(optimizer, model, path: str | Path) -> None:
    """Gather the Adam state of every parameter (collective over tp/etp/ep); rank 0 writes ``path``.

    A parameter without state yet is stored with zero moments and step 0, which Adam treats
    exactly as a fresh state.
    """
    moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}, "main": {}}
    steps: dict[str, torch.Tensor] = {}
    for name, p, main, opt in _named_slots(optimizer, model):
        state = opt.state.get(main, {})
        unknown = set(state) - set(_ADAM_KEYS)
        if unknown:
            raise GlobalStateError(f"optimizer state of {name} has {sorted(unknown)}; only Adam's "
                                   f"{list(_ADAM_KEYS)} can be checkpointed")  # fmt: skip
        for key in ("exp_avg", "exp_avg_sq"):
            moments[key][name] = state[key] if key in state else torch.zeros_like(main)
        # on the param's device: nccl gathers device tensors only
        steps[name] = torch.as_tensor(state.get("step", 0.0), dtype=torch.float32, device=main.device).reshape(1)
        if main is not p:
            moments["main"][name] = main
    out: dict[str, torch.Tensor] = {}
    for key, local in moments.items():
        if local:
            out.update({f"{key}/{n}": t for n, t in gather_global(model, local).items()})
    out.update({f"step/{n}": t for n, t in gather_global(model, steps, split=False).items()})
    out = gather_stages(out)
    if out is not None and _is_writer():
        _write(out, Path(path), OPTIMIZER_FORMAT)


def load_global_optimizer(optimizer, model, path: str | Path) -> None:
    """Set the Adam state (and fp32 master copies) of this rank's shard of every parameter from ``path``."""
    reader = _Reader(Path(path), OPTIMIZER_FORMAT)
    start, _ = _local_expert_range(model)
    offset = stage_layer_offset(model)
    with torch.no_grad():
        for name, p, main, opt in _named_slots(optimizer, model):
            g = _global_name(name, start, offset)
            if main is not p:
                key = f"main/{g}"
                main.copy_(reader.shard(key, g, main) if key in reader.keys else p.to(main.dtype))
            like = main.detach()
            step = reader.shard(f"step/{g}", g, torch.empty(1, device="cpu"), split=False).reshape(())  # a host scalar
            opt.state[main] = {
                "step": step.clone().to(torch.float32),
                "exp_avg": reader.shard(f"exp_avg/{g}", g, like).to(like.dtype, copy=True).to(like.device),
                "exp_avg_sq": reader.shard(f"exp_avg_sq/{g}", g, like).to(like.dtype, copy=True).to(like.device),
            }
