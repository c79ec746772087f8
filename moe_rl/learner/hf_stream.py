"""The learner's weights as HF-named buckets, streamed from the ranks that own them (no whole-model copy).

Owns who sends which HF tensor and the collectives that assemble each one, one bucket of
``bucket_bytes`` at a time (``HFStream.buckets``), for the weight sync and the HF export:

* every rank walks its own tensors in name order (the same order on every rank of a stage);
* a tensor replicated over data parallelism is taken from data-parallel replica 0 only (expert-data-parallel
  replica 0 for experts); a tp/etp-split tensor is gathered to tp/etp rank 0 of that replica
  (``dist.gather``: one tensor at a time, nothing lands on the other ranks);
* experts stay with their expert-parallel owner (``gather_experts=False``: the disk and tensor transports,
  each owner sends its own) or are gathered to the stage's first rank (``True``: the distributed transport,
  one source rank per pipeline stage, as slime's ``update_weight_from_distributed``) per bucket: each ep
  rank's copy of an expert tensor is received point to point only once the open bucket has room for it, so
  no rank holds more than ``bucket_bytes`` (or one tensor, when bigger) for the stream (``peak_bytes``);
* each pipeline stage streams its own layers; the caller lets stages take turns (``stage``, ``stages``).

Megatron -> HF conversion is per tensor (``hf_convert.megatron_tensor_to_hf``); a tensor that needs no
gather and no conversion is a view of the live parameter (no copy). ``plan()`` says, without any data,
which HF names and shapes this rank will send; ``nonfinite()`` checks this rank's own tensors on their
device. The ownership of global slices is ``ownership``'s. ``size_buckets`` cuts a ready HF state dict into
buckets the same way (the HF export of one process, a push from a ready state dict).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_rl.learner.hf_convert import hf_name_map, megatron_tensor_to_hf
from moe_rl.learner.model import unwrap
from moe_rl.learner.ownership import expert_slot, local_slices, tp_rank_and_size
from moe_rl.learner.tp_shards import merge_tp_shards

__all__ = ["Bucket", "HFStream", "size_buckets"]

Bucket = list[tuple[str, torch.Tensor]]


def size_buckets(named: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Consecutive groups of tensors of at most `bucket_bytes` each (a bigger tensor goes alone)."""
    out: list[Bucket] = [[]]
    size = 0
    for name, tensor in named.items():
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return [b for b in out if b]


def _ps():
    return ps


def _gather_to_first(t: torch.Tensor, group) -> list[torch.Tensor] | None:
    """Every group member's ``t`` on the group's first rank (in group-rank order), None on the others."""
    first = dist.get_global_rank(group, 0)
    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))] if dist.get_rank() == first else None
    dist.gather(t, parts, dst=first, group=group)
    return parts


class HFStream:
    """``buckets()`` (collective over this rank's stage), ``plan()``, ``nonfinite()``, ``sender``, ``stage``."""

    def __init__(self, model, model_cfg, bucket_bytes: int, gather_experts: bool = True):
        self.model, self.model_cfg, self.bucket_bytes = model, model_cfg, int(bucket_bytes)
        self.gather_experts = gather_experts
        m = unwrap(model)  # parameters and the expert-bias buffers: what the HF layout has
        self.tensors = {n: p for n, p in m.named_parameters()}
        self.tensors.update({n: b for n, b in m.named_buffers() if n.endswith("router.expert_bias")})
        self.slices = local_slices(model, self.tensors)
        self.names = hf_name_map(model_cfg)
        ps = _ps()
        self.distributed = dist.is_initialized()
        self.ep = ps.get_expert_model_parallel_world_size() if self.distributed else 1
        self.ep_rank = ps.get_expert_model_parallel_rank() if self.distributed else 0
        self.num_local = model_cfg.num_moe_experts // self.ep if model_cfg.num_moe_experts else 0
        self.stage = ps.get_pipeline_model_parallel_rank() if self.distributed else 0
        self.stages = ps.get_pipeline_model_parallel_world_size() if self.distributed else 1
        self._plan: dict | None = None
        self._size = 0  # bytes in the open bucket
        self.peak_bytes = 0  # the most this rank held for buckets() at once in several tensors (bucket + received)

    # ------------------------------------------------------------------ roles
    def _replica0(self, expert: bool) -> bool:
        if not self.distributed:
            return True
        ps = _ps()
        return (
            ps.get_expert_data_parallel_rank() if expert else ps.get_data_parallel_rank(with_context_parallel=True)
        ) == 0

    def _units(self) -> Iterator[tuple[str, str, bool, int, int, bool]]:
        """``(local name, global name, expert, tp rank, tp size, split)`` of every tensor this rank helps send."""
        for local in sorted(self.tensors):
            s = self.slices[local]
            expert = expert_slot(s.global_name) is not None
            if not self._replica0(expert):
                continue
            rank, size = tp_rank_and_size(s.global_name) if self.distributed else (0, 1)
            yield local, s.global_name, expert, rank, size, s.split and size > 1

    def _expert_names(self, g: str) -> list[str]:
        """The global names the stage's first rank receives for expert tensor ``g`` (every ep rank's)."""
        prefix, idx, suffix = expert_slot(g)
        local = idx - self.ep_rank * self.num_local
        return [f"{prefix}{r * self.num_local + local}.{suffix}" for r in range(self.ep)]

    @property
    def sender(self) -> bool:
        """True when this rank sends anything (tp/etp rank 0 of replica 0; the stage's first rank under
        ``gather_experts`` for the experts)."""
        return bool(self.plan())

    # ------------------------------------------------------------------ without data
    def plan(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{HF name: (shape, dtype)}`` this rank will send (meta tensors: no data, no communication; computed once)."""
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> dict[str, tuple[tuple[int, ...], str]]:
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for local, g, expert, rank, _, _ in self._units():
            if rank != 0:
                continue
            gathered = expert and self.gather_experts and self.ep > 1
            if gathered and self.ep_rank != 0:
                continue
            t = self.tensors[local]
            meta = torch.empty(self.slices[local].global_shape, dtype=t.dtype, device="meta")
            for mg in self._expert_names(g) if gathered else [g]:
                for name, part in megatron_tensor_to_hf(mg, meta, self.model_cfg, self.names):
                    out[name] = (tuple(part.shape), str(part.dtype).removeprefix("torch."))
        return out

    def nonfinite(self) -> str | None:
        """The global name of this rank's first tensor holding NaN/Inf (checked on its device), else None."""
        for local, t in self.tensors.items():
            if not t.is_floating_point():
                continue
            # one pass with no temporary: a NaN/Inf makes the sum non-finite (so can an overflow: then the exact check)
            if not bool(torch.isfinite(t.detach().sum())) and not bool(torch.isfinite(t).all()):
                return self.slices[local].global_name
        return None

    # ------------------------------------------------------------------ the stream
    def _held(self, tensors: int, nbytes: int) -> None:
        """Count what this rank holds for the stream right now: ``nbytes`` in ``tensors`` Megatron tensors (one
        tensor over the bucket size goes alone and is not counted: it cannot be split)."""
        if tensors > 1:
            self.peak_bytes = max(self.peak_bytes, nbytes)

    def _expert_sources(self, g: str, t: torch.Tensor) -> list[tuple[str, int | None]]:
        """Expert tensor ``g``: ``(global name, ep rank's global rank to receive it from, None: this one)`` for
        every ep rank on the group's first rank; on the others it sends its own (point to point) and gets ``[]``."""
        group = _ps().get_expert_model_parallel_group()
        first = dist.get_global_rank(group, 0)
        if dist.get_rank() != first:
            dist.send(t.detach().contiguous(), dst=first, group=group)
            return []
        names = self._expert_names(g)
        return [(names[0], None)] + [(names[r], dist.get_global_rank(group, r)) for r in range(1, self.ep)]

    def buckets(self) -> Iterator[Bucket]:
        """HF ``(name, tensor)`` lists of about ``bucket_bytes`` (a bigger tensor goes alone), on the ranks that
        send them; collective over this rank's stage (every rank of the stage must drain it). Experts gathered to
        the stage's first rank arrive one ep rank's tensor at a time, after the bucket they would overflow has
        gone: no rank holds more than ``bucket_bytes`` in several tensors for the stream (``peak_bytes`` counts it;
        a single bigger tensor goes alone)."""
        ps = _ps() if self.distributed else None
        bucket: Bucket = []
        self._size, count = 0, 0  # bytes and Megatron tensors in the open bucket
        for local, g, expert, rank, _, split in self._units():
            t = self.tensors[local].detach()
            if split:  # tp/etp shards -> the full tensor on tp/etp rank 0
                group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
                shards = _gather_to_first(t, group)
                if shards is None:
                    continue
                t = merge_tp_shards(g, shards)
            elif rank != 0:
                continue
            nbytes = t.numel() * t.element_size()
            gathered = expert and self.gather_experts and self.ep > 1
            for mg, src in self._expert_sources(g, t) if gathered else [(g, None)]:
                if bucket and self._size + nbytes > self.bucket_bytes:  # room for it first, then receive it
                    yield bucket
                    bucket, self._size, count = [], 0, 0
                full = t
                if src is not None:
                    full = torch.empty_like(t)
                    dist.recv(full, src=src, group=ps.get_expert_model_parallel_group())
                for name, part in megatron_tensor_to_hf(mg, full, self.model_cfg, self.names):
                    bucket.append((name, part))
                    self._size += part.numel() * part.element_size()
                count += 1
                self._held(count, self._size)
            del t
        if bucket:
            yield bucket
