"""Layout-free learner state: model tensors and Adam state as global tensors keyed by global names.

Owns the names and the loading of that state, whatever stores it:

* model: every parameter and persistent buffer of the ``GPTModel`` under its global name
  (``ownership``: canonical local-spec name, global layer number, global expert id);
* optimizer: for each such parameter ``exp_avg/<name>``, ``exp_avg_sq/<name>``, ``step/<name>`` and,
  where the optimizer keeps a separate fp32 master copy (Megatron's mixed-precision or distributed
  optimizer with bf16 params), ``main/<name>``.

A *source* is anything with ``keys`` (a set of global keys) and ``full(key)`` (the whole global
tensor): ``GlobalFile`` reads the previous release's single global file (``model.safetensors`` /
``optimizer.safetensors``, checkpoint format 3); ``sharded_state.ShardedDir`` (formats 4 and 5) also has
``shape(key)`` and ``part(key, slice, flat)``, which read only the saved bytes of this rank's part. Loading is local: each rank reads the global tensors it holds a part of
and slices its part for the current (tp, etp, ep, pp, dp) layout — for Megatron's distributed
optimizer its flat range of each parameter — so any checkpoint resumes on any layout, with the
distributed optimizer on or off. ``optimizer_slots`` names what every optimizer kind updates, including the
distributed optimizer's layouts under ``optimizer_cpu_offload`` with and without ``use_precision_aware_optimizer``
(``HybridDeviceOptimizer``; the one master each checkpoints: ``_distributed_slots``); ``adam_state`` /
``set_adam_state`` read and write a slot's state where that layout keeps it.

``gather_global`` / ``gather_stages`` gather this rank's tensors into whole global tensors (the
per-step HF export uses them; checkpoints no longer do). Files are safetensors (JSON header, raw
tensors): reading never unpickles.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from safetensors import SafetensorError, safe_open

from moe_rl.learner.model import unwrap
from moe_rl.learner.ownership import (
    canonical_name,
    expert_slot,
    global_name,
    globalise_layer,
    local_expert_range,
    stage_layer_offset,
    tensor_slice,
    tp_rank_and_size,
)
from moe_rl.learner.tp_shards import gather_tp_shards, tp_slice, tp_split_dim

__all__ = [
    "MODEL_FORMAT",
    "OPTIMIZER_FORMAT",
    "GlobalFile",
    "GlobalStateError",
    "Slot",
    "check_global_file",
    "gather_global",
    "gather_stages",
    "load_model",
    "load_optimizer",
    "model_tensors",
    "optimizer_slots",
    "param_state",
    "set_adam_state",
]

MODEL_FORMAT, OPTIMIZER_FORMAT = "moe_rl.global_model/1", "moe_rl.global_optimizer/1"
ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


class GlobalStateError(ValueError):
    """A global state file is unreadable, or does not fit the model (names or shapes differ)."""


def model_tensors(model) -> dict[str, torch.Tensor]:
    """The bare model's parameters and persistent buffers by state-dict name (``_extra_state`` left out)."""
    m = unwrap(model)
    return {
        k: v for k, v in m.state_dict(keep_vars=True).items() if torch.is_tensor(v) and not k.endswith("_extra_state")
    }


# ------------------------------------------------------------------------------------- gathers (export)
def gather_global(model, local: Mapping[str, torch.Tensor], split: bool = True) -> dict[str, torch.Tensor]:
    """``{state-dict name: this rank's tensor}`` -> ``{global name: full CPU tensor}`` (collective).

    Every rank of the tp, etp and ep groups calls it with the same names. ``split=False`` for
    tensors that are not sharded along the parameter's tp dim: they are only gathered over the experts.
    """

    local = {canonical_name(n): t.detach() for n, t in local.items()}
    if split and (ps.get_tensor_model_parallel_world_size() > 1 or ps.get_expert_tensor_parallel_world_size() > 1):
        local = gather_tp_shards(local, ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group())
    start, num_local = local_expert_range(model)
    ep = ps.get_expert_model_parallel_world_size()
    out: dict[str, torch.Tensor] = {}
    for name in sorted(local):
        t, slot = local[name], expert_slot(name)
        if slot is None or ep == 1:
            out[global_name(name, start)] = t.cpu().clone()
            continue
        gathered = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(gathered, t.contiguous(), group=ps.get_expert_model_parallel_group())
        for r, g in enumerate(gathered):
            out[f"{slot[0]}{r * num_local + slot[1]}.{slot[2]}"] = g.cpu()
    offset = stage_layer_offset(model)  # pp > 1: this stage's layers under their global numbers
    return {globalise_layer(k, offset): v for k, v in out.items()}


def gather_stages(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Every pipeline stage's (globally named) tensors merged on the first rank of each pipeline group,
    None on the other stages; ``state`` itself without pipeline parallelism. Collective over pp."""

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return state
    group = ps.get_pipeline_model_parallel_group()
    first = dist.get_process_group_ranks(group)[0]
    parts = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    # size: the whole model. TEST ORACLE ONLY (export_hf_state_dict, for tests and benchmarks on small models);
    # the trainer streams (hf_stream) and tests/house/test_small_gathers.py keeps it out of every other module
    dist.gather_object(state, parts, dst=first, group=group)
    if parts is None:
        return None
    return {k: v for part in parts for k, v in part.items()}


# ------------------------------------------------------------------------------------- sources
def check_global_file(path: str | Path, fmt: str) -> None:
    """GlobalStateError unless ``path`` is a readable safetensors file written with format ``fmt``."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            got = (fh.metadata() or {}).get("format")
    except (SafetensorError, OSError) as exc:
        raise GlobalStateError(f"{path} is missing or not a readable safetensors file ({exc})") from None
    if got != fmt:
        raise GlobalStateError(f"{path} has format {got!r}; expected {fmt!r}")


class GlobalFile:
    """Source: one safetensors file of whole global tensors (checkpoint format 3, the previous release)."""

    def __init__(self, path: str | Path, fmt: str):
        check_global_file(path, fmt)
        self.where = Path(path)
        self.fh = safe_open(str(path), framework="pt", device="cpu")
        self.keys = set(self.fh.keys())

    def full(self, key: str) -> torch.Tensor:
        return self.fh.get_tensor(key)


def _local_part(
    source, key: str, name: str, like: torch.Tensor, split: bool = True, flat: tuple[int, int] | None = None
) -> torch.Tensor:
    """This rank's part of global tensor ``key`` (tp/etp-sliced as ``name`` is), checked against ``like``; with
    ``flat``, that range of it flattened. A source with ``part`` (``ShardedDir``) reads only those bytes."""
    if key not in source.keys:
        raise GlobalStateError(f"{source.where} lacks {key!r}; expected the same model config (names differ)")
    rank, size = tp_rank_and_size(name) if split else (0, 1)
    if hasattr(source, "part"):
        s = tensor_slice(name, name, tuple(like.shape), rank, size)
        saved = source.shape(key)
        if saved != s.global_shape:
            dim, _ = tp_split_dim(name)
            held = tuple(n // size if d == dim else n for d, n in enumerate(saved))
            on_rank = f" ({held} on this rank)" if held != saved else ""
            raise GlobalStateError(
                f"{source.where}: size mismatch for {key}: saved {saved}{on_rank}, the "
                f"model expects {tuple(like.shape)}; the model config differs"
            )
        return source.part(key, s, flat)
    full = source.full(key)
    part = tp_slice(name, full, rank, size)
    if part.shape != like.shape:
        on_rank = f" ({tuple(part.shape)} on this rank)" if part.shape != full.shape else ""
        raise GlobalStateError(
            f"{source.where}: size mismatch for {key}: saved {tuple(full.shape)}{on_rank}, the "
            f"model expects {tuple(like.shape)}; the model config differs"
        )
    return part.reshape(-1)[flat[0] : flat[1]] if flat else part


def load_model(model, source) -> None:
    """Copy this rank's part of every tensor of ``source`` into ``model`` (local; every tensor required)."""
    start, _ = local_expert_range(model)
    offset = stage_layer_offset(model)
    with torch.no_grad():
        for name, tensor in model_tensors(model).items():
            g = global_name(name, start, offset)
            tensor.copy_(_local_part(source, g, g, tensor))


# ------------------------------------------------------------------------------------- optimizer
@dataclass(frozen=True)
class Slot:
    """One parameter as an optimizer sees it: ``main`` is what it updates (``param`` itself, an fp32
    master copy, or a distributed optimizer's flat shard ``[start, stop)`` of ``param`` flattened), never None.

    ``opt.state[key]`` holds its Adam state (``key`` is ``main`` but under Megatron's ``HybridDeviceOptimizer``,
    whose inner torch optimizer steps a host copy); ``mirrors`` are tensors a load writes ``main`` into too (the
    host copy HDO steps); ``owner`` is the ``DistributedOptimizer`` whose accessor reads the state.
    """

    param: torch.Tensor
    main: torch.Tensor
    opt: torch.optim.Optimizer
    flat_range: tuple[int, int] | None = None
    key: torch.Tensor | None = None
    mirrors: tuple[torch.Tensor, ...] = ()
    owner: object = None
    hdo: tuple | None = None  # (HybridDeviceOptimizer, the tensor its own state is keyed by)

    @property
    def separate_main(self) -> bool:
        """True when ``main`` is an fp32 master copy, not ``param`` (or a view of it)."""
        return self.main is not self.param and self.param.dtype != self.main.dtype

    @property
    def state_key(self) -> torch.Tensor:
        return self.main if self.key is None else self.key


def _distributed_slots(optimizer) -> Iterator[Slot]:
    """Megatron's ``DistributedOptimizer``: this dp rank's flat range of each parameter, in each layout it builds.

    The inner optimizer's param (``param_groups[g][i]`` for ``model_param_group_index_map[p] == (g, i)``, as
    Megatron's ``_get_main_param_and_optimizer_states`` finds it) is the fp32 master shard, or the model
    param's shard (fp32 params; and bf16 ones under ``use_precision_aware_optimizer_no_fp8_or_ds_fp8``, where
    ``shard_main_param`` is None). Under ``HybridDeviceOptimizer`` (``optimizer_cpu_offload``) the torch
    optimizer steps HDO's inner tensor of it (a host copy, fp32 under ``param_update_in_fp32``):

    * offload + precision-aware: main = that fp32 inner tensor (HDO's ``master_param``), the only master;
    * offload alone: main = ``shard_main_param`` (the accessor's ``param``, format-compatible with no offload),
      mirrored into HDO's host copy (its ``master_param``), which equals it after every step (HDO copies the
      host result back into it); a load writes both;
    * no offload: main = the inner param, as before.
    """
    inner_opt = optimizer.optimizer
    hdo = inner_opt if isinstance(inner_opt, HybridDeviceOptimizer) else None
    precision_aware = optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    stepped_by = {
        id(x): o for o in (hdo.sub_optimizers if hdo else ()) for grp in o.param_groups for x in grp["params"]
    }
    for model_groups in (optimizer.model_float16_groups, optimizer.model_fp32_groups):
        for group in model_groups:
            for p in group:
                g, i = optimizer.model_param_group_index_map[p]
                opt_param = inner_opt.param_groups[g]["params"][i]
                r = optimizer._get_model_param_range_map(p)["param"]
                if hdo is None:
                    yield Slot(p, opt_param, inner_opt, (r.start, r.end), owner=optimizer)
                    continue
                inner = hdo.param_to_inner_param[opt_param]
                main = inner if precision_aware else opt_param
                mirrors = () if inner is main else (inner,)
                yield Slot(
                    p, main, stepped_by[id(inner)], (r.start, r.end), inner, mirrors, optimizer, (hdo, opt_param)
                )


def optimizer_slots(optimizer) -> Iterator[Slot]:
    """Every parameter the optimizer updates on this rank: torch optimizers (the CPU learner without the
    distributed optimizer), Megatron's Float16 / FP32 / Distributed optimizers (with or without CPU offload and
    the precision-aware optimizer) and ``ChainedOptimizer``."""
    if optimizer is None:  # Megatron's stub optimizer of a rank without parameters in that chain
        return
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                yield Slot(p, p, optimizer)
    elif hasattr(optimizer, "chained_optimizers"):
        for opt in optimizer.chained_optimizers:
            yield from optimizer_slots(opt)
    elif hasattr(optimizer, "shard_fp32_groups"):  # DistributedOptimizer: this dp rank's range of each param
        yield from _distributed_slots(optimizer)
    elif hasattr(optimizer, "fp32_from_float16_groups"):
        for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups, strict=True):
            for p, main in zip(model_group, main_group, strict=True):
                yield Slot(p, main, optimizer.optimizer)
        for group in optimizer.fp32_from_fp32_groups:
            for p in group:
                yield Slot(p, p, optimizer.optimizer)
    elif hasattr(optimizer, "optimizer"):
        yield from optimizer_slots(optimizer.optimizer)
    else:
        raise GlobalStateError(
            f"cannot read the state of a {type(optimizer).__name__} optimizer; expected a "
            "torch optimizer or Megatron's (Chained/Float16/FP32/Distributed) optimizer"
        )


def param_state(optimizer, param) -> dict:
    """The Adam state (``exp_avg``, ``exp_avg_sq``, ``step``) the optimizer keeps for model parameter ``param``
    (under the distributed optimizer: for this rank's shard of it)."""
    for slot in optimizer_slots(optimizer):
        if slot.param is param:
            return slot.opt.state.get(slot.state_key, {})
    raise KeyError("the optimizer does not update this parameter")


def named_slots(optimizer, model) -> Iterator[tuple[str, Slot]]:
    """``(state-dict name, Slot)`` per parameter the optimizer updates on this rank."""
    names = {id(t): n for n, t in model_tensors(model).items()}
    for slot in optimizer_slots(optimizer):
        if id(slot.param) not in names:
            raise GlobalStateError("the optimizer updates a tensor that is not a parameter of the model")
        yield names[id(slot.param)], slot


def adam_state(name: str, slot: Slot) -> dict[str, torch.Tensor]:
    """``exp_avg``, ``exp_avg_sq`` (shaped as ``slot.main``) and ``step`` (a host scalar) of a slot; zeros before
    its first step (Adam treats zero moments at step 0 exactly as a fresh state). Under the distributed
    optimizer read through Megatron's ``_get_main_param_and_optimizer_states``, whose ``param`` must be
    ``slot.main`` or (offload alone) its mirror."""
    state = dict(slot.opt.state.get(slot.state_key, {}))
    if state and slot.owner is not None:
        state = dict(slot.owner._get_main_param_and_optimizer_states(slot.param))
        main = state.pop("param")
        master = state.get("master_param", slot.main)
        if main is not slot.main or not any(master is t for t in (slot.main, *slot.mirrors)):
            raise GlobalStateError(f"optimizer state of {name}: Megatron's main param is not the one checkpointed")
    if state.get("master_param") is not None and any(state["master_param"] is t for t in (slot.main, *slot.mirrors)):
        del state["master_param"]  # HybridDeviceOptimizer's name for the tensor it steps: main or its mirror
    unknown = set(state) - set(ADAM_KEYS)
    if unknown:
        raise GlobalStateError(
            f"optimizer state of {name} has {sorted(unknown)}; only Adam's {list(ADAM_KEYS)} can be checkpointed"
        )
    out = {k: state[k] if k in state else torch.zeros_like(slot.main) for k in ("exp_avg", "exp_avg_sq")}
    out["step"] = torch.as_tensor(state.get("step", 0.0), dtype=torch.float32, device="cpu").detach().reshape(1)
    return out


def set_adam_state(slot: Slot, main: torch.Tensor | None, exp_avg, exp_avg_sq, step: torch.Tensor) -> None:
    """Write a slot's master (into ``main`` and its mirrors; None: leave them) and Adam state, in place where the
    optimizer keeps it (``HybridDeviceOptimizer``: its inner torch optimizer's state, which HDO's own ``state``
    shares, with ``master_param`` naming the tensor it steps, as HDO leaves them after a step)."""
    with torch.no_grad():
        if main is not None:
            for t in (slot.main, *slot.mirrors):
                t.copy_(main.reshape(t.shape))
    like = slot.state_key.detach()  # the tensor the torch optimizer steps (HDO: its host copy)
    state = slot.opt.state[slot.state_key]
    state.clear()
    state.update(
        step=step.clone().to(torch.float32),
        exp_avg=exp_avg.to(like.dtype, copy=True).to(like.device),
        exp_avg_sq=exp_avg_sq.to(like.dtype, copy=True).to(like.device),
    )
    if slot.hdo is not None:
        hdo, hdo_key = slot.hdo
        if hdo.param_update_in_fp32:
            state["master_param"] = slot.state_key
        hdo.state[hdo_key] = state


def _slot_part(source, key: str, name: str, slot: Slot) -> torch.Tensor:
    """This rank's part of global ``key`` shaped as ``slot.main`` (its flat range under the distributed optimizer)."""
    return _local_part(source, key, name, slot.param, flat=slot.flat_range)


def load_optimizer(optimizer, model, source) -> None:
    """Set the Adam state (and fp32 master copies) of this rank's part of every parameter from ``source``.

    Call after ``load_model``: a master copy the source lacks (it was written without one) starts from the
    loaded parameter, as Megatron's own optimizer initialises it.
    """
    start, _ = local_expert_range(model)
    offset = stage_layer_offset(model)
    for name, slot in named_slots(optimizer, model):
        g = global_name(name, start, offset)
        lo, hi = slot.flat_range or (0, slot.param.numel())
        main = None
        if slot.separate_main and f"main/{g}" in source.keys:
            main = _slot_part(source, f"main/{g}", g, slot)
        elif slot.main.untyped_storage().data_ptr() != slot.param.untyped_storage().data_ptr() or slot.mirrors:
            main = slot.param.detach().reshape(-1)[lo:hi]  # a master the source lacks starts from the parameter
        step = _local_part(source, f"step/{g}", g, torch.empty(1, device="cpu"), split=False).reshape(())
        moments = (_slot_part(source, f"{k}/{g}", g, slot) for k in ("exp_avg", "exp_avg_sq"))
        set_adam_state(slot, main, *moments, step)
