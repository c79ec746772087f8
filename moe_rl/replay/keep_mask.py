"""Keep Sampling Mask: the learner's log-prob of a sampled token renormalised over the
rollout's kept set (top-k / top-p truncation), for old, current and reference passes.

Owns only the math on ``logits[N, V]`` -- whole, or one tensor-parallel rank's vocabulary shard
``logits[N, V/tp]`` as Megatron's vocab-parallel output layer returns it (logsumexp over the kept
ids across tp shards: one max and one sum all-reduce per pass), and Σ_v π_v² of the same kept-set
distribution (the optimal token baselines' input). It must not know about models or batches.
Semantics: seed 000 and field-facts.md "Recurring user bugs" #10 -- the sampled token is
always part of its kept set, even where the engine's returned mask disagrees at the cutoff.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

__all__ = ["KeepMaskResult", "KeptSets", "VocabShard", "keep_mask_logprobs", "kept_mask", "kept_sum_pi_squared"]


@dataclass(frozen=True)
class KeptSets:
    """Ragged kept sets of ``N`` tokens: row ``i`` keeps ``ids[offsets[i]:offsets[i+1]]``.

    ``ids[M]`` int, ``offsets[N+1]`` int64, non-decreasing, ``offsets[0] == 0``,
    ``offsets[-1] == M``. An empty row means "no truncation" (full vocabulary): a real kept
    set is never empty because it contains at least the sampled token.
    """

    ids: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def from_lists(cls, rows: list, device=None) -> KeptSets:
        """Build from one id sequence (or ``None`` = no truncation) per token."""
        lengths = [0 if r is None else len(r) for r in rows]
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64, device=device)
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64, device=device), 0)
        flat = [int(x) for r in rows if r is not None for x in r]
        return cls(torch.tensor(flat, dtype=torch.int64, device=device), offsets)

    @classmethod
    def from_numpy(cls, ids, offsets, device=None) -> KeptSets:
        """From a ``RolloutBatch``'s ``mask_ids[M]`` / ``mask_offsets[N+1]`` (or a slice re-based to 0)."""
        offsets = torch.as_tensor(offsets, dtype=torch.int64, device="cpu")  # host: sliced by value below
        ids = torch.as_tensor(ids, device="cpu")[int(offsets[0]) : int(offsets[-1])]
        return cls(ids.to(device=device, dtype=torch.int64), (offsets - offsets[0]).to(device))

    @property
    def num_rows(self) -> int:
        return int(self.offsets.numel()) - 1


@dataclass(frozen=True)
class KeepMaskResult:
    """``logp[N]`` renormalised log-probs; ``outside_mask[N]`` True where the sampled token
    was missing from a non-empty kept set (engine/learner cutoff disagreement)."""

    logp: torch.Tensor
    outside_mask: torch.Tensor

    @property
    def num_outside(self) -> int:
        return int(self.outside_mask.sum())


@dataclass(frozen=True)
class VocabShard:
    """Which slice of the vocabulary this rank's logits hold: ids ``[start, start + size)`` of ``vocab_size``.

    ``group`` is the tensor-parallel process group the vocabulary is split over (None: whole
    vocabulary, no communication). Rank ``r`` of a ``tp``-group holds ``[r * V/tp, (r+1) * V/tp)``.
    """

    start: int
    size: int
    vocab_size: int
    group: object = None

    @classmethod
    def of(cls, logits: torch.Tensor, tp_group=None) -> VocabShard:
        size = logits.shape[-1]
        if tp_group is None:
            return cls(0, size, size)

        return cls(dist.get_rank(tp_group) * size, size, size * dist.get_world_size(tp_group), tp_group)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over shards; the gradient passes through unchanged (every rank holds the same loss)."""
        if self.group is None:
            return x

        return reduce_from_tensor_model_parallel_region(x, group=self.group)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Max over shards, detached (a shift that cancels in every gradient)."""
        x = x.detach()
        if self.group is None:
            return x

        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def logsumexp(self, z: torch.Tensor) -> torch.Tensor:
        """``logsumexp`` over the whole vocabulary of ``z[R, size]`` -> ``[R]``."""
        if self.group is None:
            return torch.logsumexp(z, dim=-1)
        m = self.max(z.amax(dim=-1))
        return torch.log(self.sum(torch.exp(z - m[:, None]).sum(dim=-1))) + m


def kept_mask(kept: KeptSets, vocab_size: int, device=None) -> torch.Tensor:
    """``bool [N, vocab_size]``: True at each row's kept ids; an empty row (no truncation) is all True.
    The input of ``moe_rl.exact.kernels.kept_token_logprobs`` (Keep Sampling Mask under true-on-policy)."""
    device = kept.ids.device if device is None else device
    lengths = kept.offsets.diff().to(device)
    rows = torch.arange(kept.num_rows, device=device)
    mask = torch.zeros(kept.num_rows, vocab_size, dtype=torch.bool, device=device)
    mask[lengths == 0] = True
    mask[torch.repeat_interleave(rows, lengths), kept.ids.to(device=device, dtype=torch.int64)] = True
    return mask


def _check(
    logits: torch.Tensor, targets: torch.Tensor, kept: KeptSets | None, temperature: float, V: int | None = None
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V]; got shape {tuple(logits.shape)}")
    N = logits.shape[0]
    V = logits.shape[1] if V is None else V
    if targets.shape != (N,):
        raise ValueError(f"targets must be [N]={N}; got shape {tuple(targets.shape)}")
    if N and (int(targets.min()) < 0 or int(targets.max()) >= V):
        lo, hi = int(targets.min()), int(targets.max())
        raise ValueError(f"targets must be token ids in [0, {V}); got range [{lo}, {hi}]")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if kept is None:
        return
    if kept.offsets.dim() != 1 or kept.num_rows != N:
        raise ValueError(f"kept.offsets must be [N+1]={N + 1}; got shape {tuple(kept.offsets.shape)}")
    M = kept.ids.numel()
    if int(kept.offsets[0]) != 0 or int(kept.offsets[-1]) != M or bool((kept.offsets.diff() < 0).any()):
        raise ValueError(
            f"kept.offsets must start at 0, end at len(kept.ids)={M} and never decrease; "
            f"got first={int(kept.offsets[0])} last={int(kept.offsets[-1])}"
        )
    if M and (int(kept.ids.min()) < 0 or int(kept.ids.max()) >= V):
        lo, hi = int(kept.ids.min()), int(kept.ids.max())
        raise ValueError(f"kept.ids must be token ids in [0, {V}); got range [{lo}, {hi}]")


def keep_mask_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, kept: KeptSets | None, temperature: float = 1.0, tp_group=None
) -> KeepMaskResult:
    """``logits[N, V]``, ``targets[N]`` -> ``logp[N] = z[y] - logsumexp(z[kept ∪ {y}])``, ``z = logits / T``.

    Rows with an empty kept set (and every row when ``kept`` is None) use the full softmax.
    Vectorised over the ``M`` kept ids: cost O(M log M) for the sets plus O(N_full * V) for
    untruncated rows, never a Python loop over tokens. Differentiable w.r.t. ``logits``.

    With ``tp_group``, ``logits[N, V/tp]`` is this rank's vocabulary shard (``VocabShard``);
    ``targets`` and ``kept`` hold global ids. Collective over ``tp_group``: every rank returns the
    same ``logp[N]``, and the gradient reaches each rank's shard only.
    """
    shard = VocabShard.of(logits, tp_group)
    _check(logits, targets, kept, temperature, V=shard.vocab_size)
    targets = targets.to(logits.device)  # kept sets are moved below; outputs live on logits.device
    N, V = logits.shape[0], shard.vocab_size
    # One fp32 (or wider) upcast shared by every term; only gathered entries (and untruncated
    # rows) are scaled, so truncated rows never touch the full vocabulary.
    dtype = torch.promote_types(logits.dtype, torch.float32)

    def z(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) / temperature

    def local(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids in this shard, as local column indices clamped into range)."""
        here = (ids >= shard.start) & (ids < shard.start + shard.size)
        return here, (ids - shard.start).clamp(0, shard.size - 1)

    rows = torch.arange(N, device=logits.device)
    here, cols = local(targets)
    z_target = shard.sum(torch.where(here, z(logits[rows, cols]), torch.zeros((), dtype=dtype, device=logits.device)))
    outside = torch.zeros(N, dtype=torch.bool, device=logits.device)
    if kept is None:
        return KeepMaskResult(z_target - shard.logsumexp(z(logits)), outside)

    lse = torch.empty(N, dtype=dtype, device=logits.device)
    lengths = kept.offsets.diff().to(logits.device)
    full = lengths == 0
    if bool(full.any()):
        lse[full] = shard.logsumexp(z(logits[full]))
    trunc_rows = rows[~full]
    if trunc_rows.numel():
        ids = kept.ids.to(device=logits.device, dtype=torch.int64)
        seg = torch.repeat_interleave(rows, lengths)
        # Keys row*V + id make set membership and de-duplication one sort each.
        keys = seg * V + ids
        target_keys = trunc_rows * V + targets[trunc_rows]
        outside[trunc_rows] = ~torch.isin(target_keys, keys)
        keys = torch.unique(torch.cat([keys, target_keys]))
        seg, ids = keys // V, keys % V
        here, cols = local(ids)
        seg, cols = seg[here], cols[here]
        vals = z(logits[seg, cols])
        # Stable segment logsumexp: subtract a per-row max (detached; it cancels in the gradient).
        row_max = torch.full((N,), float("-inf"), dtype=dtype, device=logits.device)
        row_max = shard.max(row_max.scatter_reduce(0, seg, vals.detach(), reduce="amax", include_self=True))
        sums = torch.zeros(N, dtype=dtype, device=logits.device).index_add(0, seg, torch.exp(vals - row_max[seg]))
        lse[trunc_rows] = (torch.log(shard.sum(sums)) + row_max)[trunc_rows]
    return KeepMaskResult(z_target - lse, outside)


@torch.no_grad()
def kept_sum_pi_squared(
    logits: torch.Tensor, targets: torch.Tensor, kept: KeptSets, temperature: float = 1.0, tp_group=None
) -> torch.Tensor:
    """``logits[N, V]`` -> Σ_{v∈K} π_v² ``[N]`` of softmax(z) renormalised over each row's kept set K.

    K = ``kept ∪ {target}`` as in :func:`keep_mask_logprobs` (an empty row: the full vocabulary), so the π
    whose squares are summed is the distribution the row's log-prob is of. With e_v = exp(z_v − max_K z):
    Σπ² = Σ_K e² / (Σ_K e)², both sums over the tp shards (``tp_group``: ``logits`` is this rank's shard).
    No gradient; at least fp32.
    """
    shard = VocabShard.of(logits, tp_group)
    _check(logits, targets, kept, temperature, V=shard.vocab_size)
    targets = targets.to(logits.device)
    N, V = logits.shape[0], shard.vocab_size
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = torch.empty(N, dtype=dtype, device=logits.device)
    rows = torch.arange(N, device=logits.device)
    lengths = kept.offsets.diff().to(logits.device)
    full = lengths == 0
    if bool(full.any()):
        z = logits[full].to(dtype) / temperature
        e = torch.exp(z - shard.max(z.amax(dim=-1))[:, None])
        out[full] = shard.sum(e.pow(2).sum(-1)) / shard.sum(e.sum(-1)).pow(2)
    trunc_rows = rows[~full]
    if trunc_rows.numel():
        ids = kept.ids.to(device=logits.device, dtype=torch.int64)
        keys = torch.repeat_interleave(rows, lengths) * V + ids
        keys = torch.unique(torch.cat([keys, trunc_rows * V + targets[trunc_rows]]))
        seg, ids = keys // V, keys % V
        here = (ids >= shard.start) & (ids < shard.start + shard.size)
        seg, cols = seg[here], (ids - shard.start)[here]
        vals = logits[seg, cols].to(dtype) / temperature
        row_max = torch.full((N,), float("-inf"), dtype=dtype, device=logits.device)
        row_max = shard.max(row_max.scatter_reduce(0, seg, vals, reduce="amax", include_self=True))
        e = torch.exp(vals - row_max[seg])
        sums = torch.zeros(2, N, dtype=dtype, device=logits.device)
        sums[0].index_add_(0, seg, e)
        sums[1].index_add_(0, seg, e * e)
        sums = shard.sum(sums)
        out[trunc_rows] = (sums[1] / sums[0].pow(2))[trunc_rows]
    return out
