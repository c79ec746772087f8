"""Rollout records -> learner tensors: microbatches and response-aligned minibatch rows.

Owns the alignment between the records' layout and the learner's. For sample ``i`` with
``tokens = prompt ++ response`` (``P + R`` tokens) the learner's input is ``tokens[:-1]`` and
its targets ``tokens[1:]``: response token ``j`` is scored at position ``P - 1 + j``. Route
row ``t`` (``P + R - 1`` rows) routes input position ``t``, so no row is missing and none is
shifted. Padded positions get pad routes with distinct, spread experts and an empty kept set.

Two layouts meet here:
- a microbatch ``[B, T]`` (``T`` = its longest sample; what the model sees);
- response rows ``[n, R]`` (row = sample, column = response token ``j``, ``R`` fixed for the
  whole minibatch), the layout of the step-global algorithm phases and of the per-sample
  values kept across passes (π_old, detached π_θ). ``Microbatch.to_rows`` / ``from_rows``
  convert, so a value never depends on how samples were grouped or padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.records import RecordError, RolloutBatch
from moe_rl.records.trajectory import loss_token_mask
from moe_rl.replay.driver import MicrobatchRoutes
from moe_rl.replay.keep_mask import KeptSets
from moe_rl.replay.layout import pack_microbatch_routes

__all__ = [
    "Microbatch",
    "build_microbatch",
    "check_ksm_records",
    "kept_set_outside_fraction",
    "response_row_mask",
    "response_rows",
]


def _response_offsets(batch: RolloutBatch) -> np.ndarray:
    offsets = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum(batch.response_lens, out=offsets[1:])
    return offsets


def response_rows(batch: RolloutBatch, ids: Sequence[int], width: int, *, kept_logp: bool = False) -> torch.Tensor:
    """Behaviour log-probs μ of ``ids`` as response rows ``[n, width]`` float32 (0 past each response).

    ``kept_logp`` takes the engine's kept-set-renormalised log-probs (Keep Sampling Mask).
    """
    values = batch.sampling_logp if kept_logp else batch.rollout_logp
    offsets = _response_offsets(batch)
    out = np.zeros((len(ids), width), dtype=np.float32)
    for row, i in enumerate(ids):
        seg = values[offsets[i] : offsets[i + 1]]
        out[row, : len(seg)] = seg
    return torch.from_numpy(out)


def response_row_mask(batch: RolloutBatch, ids: Sequence[int], width: int) -> torch.Tensor:
    """``mask[n, width]``: True at the response tokens of ``ids`` the loss may train on: every one of a single-turn
    batch, the generated ones of a multi-turn trajectory (``loss_mask``: environment tokens never train)."""
    lens = torch.as_tensor(batch.response_lens[list(ids)].astype(np.int64))
    mask = torch.arange(width)[None, :] < lens[:, None]
    if (loss := loss_token_mask(batch)) is None:
        return mask
    offsets = _response_offsets(batch)
    rows = np.zeros((len(ids), width), dtype=bool)
    for row, i in enumerate(ids):
        seg = loss[offsets[i] : offsets[i + 1]]
        rows[row, : len(seg)] = seg
    return mask & torch.from_numpy(rows)


def check_ksm_records(batch: RolloutBatch) -> None:
    """Keep Sampling Mask needs kept sets and kept-set log-probs in the records; one clear error if not."""
    missing = []
    if batch.mask_offsets is None or batch.mask_ids is None:
        missing.append("the sampling masks (meta_info 'output_token_sampling_mask')")
    if batch.sampling_logp is None:
        missing.append("the kept-set log-probs (meta_info 'output_token_sampling_logprobs')")
    if missing:
        raise RecordError(
            "replay.keep_sampling_mask=true but the rollout records lack "
            + " and ".join(missing)
            + "; the rollout request must set return_sampling_mask=true (the client does when "
            "replay.keep_sampling_mask is on), or set replay.keep_sampling_mask=false"
        )


def kept_set_outside_fraction(batch: RolloutBatch, group=None) -> float:
    """Fraction of response tokens whose sampled id is missing from a non-empty kept set (cutoff disagreement),
    over the tokens ``batch`` holds, summed over the data-parallel ``group``'s shares (a 2-number all-reduce)."""
    if batch.mask_offsets is None:
        return 0.0
    counts = np.diff(batch.mask_offsets)
    token = np.repeat(np.arange(len(counts)), counts)
    hit = batch.mask_ids == np.repeat(batch.response_ids, counts)
    inside = np.bincount(token[hit], minlength=len(counts)) > 0
    totals = torch.tensor([int(((~inside) & (counts > 0)).sum()), len(counts)], dtype=torch.float64, device="cpu")
    if batch.held is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        totals = totals.to(dev)
        dist.all_reduce(totals, group=group)  # size: 2 numbers
    return float(totals[0] / max(float(totals[1]), 1.0))


def _kept_sets(batch: RolloutBatch, ids, prompt_lens, T: int) -> KeptSets:
    """Kept sets over the ``B*T`` flattened target rows (empty row = full softmax)."""
    lengths = np.zeros(len(ids) * T, dtype=np.int64)
    chunks = []
    held = np.zeros(len(batch.held_lens(batch.response_lens)) + 1, dtype=np.int64)  # the kept sets' rows
    np.cumsum(batch.held_lens(batch.response_lens), out=held[1:])
    for b, i in enumerate(ids):
        k = batch.position(i)
        r0, r1 = held[k], held[k + 1]
        offs = batch.mask_offsets[r0 : r1 + 1]
        row0 = b * T + int(prompt_lens[b]) - 1
        lengths[row0 : row0 + (r1 - r0)] = np.diff(offs)
        chunks.append(batch.mask_ids[offs[0] : offs[-1]])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
    return KeptSets.from_numpy(flat, offsets)


@dataclass
class Microbatch:
    """One microbatch of ``B`` samples padded to ``T`` positions.

    ``tensors`` (what the learner and the loss read): ``input_ids[B, T]``, ``targets[B, T]`` (-1 on
    padding), ``mask[B, T]`` (positions scoring a response token), ``valid[B, T]`` (real
    positions), ``padding_mask[B, T]`` (True = padding; Megatron's convention), ``rollout_logp[B, T]``
    (μ), ``advantages[B]`` (or ``[B, T]`` from per-token rows), ``kept`` (``KeptSets`` or absent). In a multi-turn trajectory ``mask`` leaves out the
    environment tokens (their positions count as ``prompt`` positions in the replay metrics; R3 still replays the
    recorded route of every position). ``routes`` is what the replay driver
    reads. ``_pos`` maps response rows to microbatch positions.
    """

    sample_ids: tuple[int, ...]
    tensors: dict
    routes: MicrobatchRoutes
    _pos: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (row b, position t, response column j) per token

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Response rows ``[B, R]`` of this microbatch's samples -> ``[B, T]`` (0 elsewhere)."""
        b, t, j = self._pos
        out = torch.zeros(self.tensors["mask"].shape, dtype=rows.dtype, device=rows.device)
        out[b, t] = rows[b, j]
        return out

    def to_rows(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """``x[B, T]`` -> response rows ``[B, width]`` (0 past each response)."""
        b, t, j = self._pos
        out = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
        out[b, j] = x[b, t]
        return out


def build_microbatch(
    batch: RolloutBatch,
    ids: Sequence[int],
    advantages: torch.Tensor,
    *,
    num_experts: int,
    kept_logp: bool,
    with_kept_sets: bool,
    device: torch.device | str = "cpu",
) -> Microbatch:
    """The learner tensors of samples ``ids`` (see ``Microbatch``), on ``device``.

    ``advantages[N]`` are per sample of the whole batch, or ``[N, R]`` response rows (per token: they go to
    ``[B, T]`` like μ). ``kept_logp`` takes the kept-set
    log-probs as μ (Keep Sampling Mask); ``with_kept_sets`` adds the kept sets. Routes (when
    the records have them) stay on the host; the replay binding copies them once per forward.
    """
    ids = tuple(int(i) for i in ids)
    samples = [batch.sample(i) for i in ids]
    B = len(samples)
    T = max(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    targets = torch.full((B, T), -1, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    rows_b, rows_t, rows_j = [], [], []
    for b, s in enumerate(samples):
        tokens = torch.from_numpy(np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64))
        n, P, R = len(tokens) - 1, len(s.prompt_ids), len(s.response_ids)
        input_ids[b, :n] = tokens[:-1]
        targets[b, :n] = tokens[1:]
        valid[b, :n] = True
        rows_b.append(torch.full((R,), b, dtype=torch.long))
        rows_t.append(torch.arange(P - 1, P - 1 + R))
        rows_j.append(torch.arange(R))
    host_pos = tuple(torch.cat(x) for x in (rows_b, rows_t, rows_j))
    width = int(batch.response_lens[list(ids)].max())
    mask = torch.zeros(B, T, dtype=torch.bool)  # positions scoring a token the loss trains on (not environment)
    mask[host_pos[0], host_pos[1]] = response_row_mask(batch, ids, width)[host_pos[0], host_pos[2]]
    pos = tuple(x.to(device) for x in host_pos)
    mu = response_rows(batch, ids, width, kept_logp=kept_logp)
    tensors = {
        "input_ids": input_ids.to(device),
        "targets": targets.to(device),
        "mask": mask.to(device),
        "valid": valid.to(device),
        "padding_mask": (~valid).to(device),
        "sample_ids": ids,
    }
    if with_kept_sets:
        tensors["kept"] = _kept_sets(batch, ids, [len(s.prompt_ids) for s in samples], T)
        tensors["kept"] = KeptSets(tensors["kept"].ids.to(device), tensors["kept"].offsets.to(device))
    routes = None
    if batch.routes is not None:
        routes = pack_microbatch_routes([s.routes for s in samples], T, num_experts, first_sample=ids[0])
    mb = Microbatch(ids, tensors, MicrobatchRoutes(ids, valid, routes, response=mask), pos)
    tensors["rollout_logp"] = mb.from_rows(mu.to(device))
    adv = advantages[list(ids)].to(device=device, dtype=torch.float32)
    tensors["advantages"] = mb.from_rows(adv) if adv.dim() == 2 else adv
    return mb
