"""Rollout records -> learner microbatches: padded token tensors, masks, routes and kept sets.

Owns the alignment between the records' layout and the learner's tensors. For sample
``i`` with ``tokens = prompt ++ response`` (``P + R`` tokens) the learner's input is
``tokens[:-1]`` and its targets ``tokens[1:]``; response token ``j`` is target position
``P - 1 + j``. Route row ``t`` (``P + R - 1`` rows) routes input position ``t``, so no
row is missing and none is shifted. Padded positions get pad routes with distinct,
spread experts and an empty kept set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_rl.records import RolloutBatch
from moe_rl.replay.driver import MicrobatchRoutes
from moe_rl.replay.keep_mask import KeptSets
from moe_rl.replay.layout import pack_microbatch_routes


@dataclass
class LearnerMicrobatch:
    """One microbatch: ``tensors`` is what the learner's train step and loss read."""

    tensors: dict
    routes: MicrobatchRoutes
    num_outside_mask: int  # sampled tokens the engine's kept set did not contain (cutoff disagreement)


def _kept_sets(batch: RolloutBatch, sample_ids, prompt_lens, T: int) -> tuple[KeptSets, int]:
    """Kept sets over the ``B*T`` flattened target rows (empty = full softmax) + count of outside targets."""
    lengths = np.zeros(len(sample_ids) * T, dtype=np.int64)
    chunks, outside = [], 0
    resp_offsets = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum(batch.response_lens, out=resp_offsets[1:])
    for b, i in enumerate(sample_ids):
        r0, r1 = resp_offsets[i], resp_offsets[i + 1]
        offs = batch.mask_offsets[r0 : r1 + 1]
        ids = batch.mask_ids[offs[0] : offs[-1]]
        row0 = b * T + int(prompt_lens[b]) - 1
        lengths[row0 : row0 + (r1 - r0)] = np.diff(offs)
        chunks.append(ids)
        counts = np.diff(offs)
        seg = np.repeat(np.arange(r1 - r0), counts)  # response token of each kept id
        match = ids == np.repeat(batch.response_ids[r0:r1], counts)
        outside += int(((np.bincount(seg[match], minlength=r1 - r0) == 0) & (counts > 0)).sum())
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
    return KeptSets.from_numpy(flat, offsets), outside


def build_microbatches(
    batch: RolloutBatch,
    sample_ids: list[int],
    advantages: torch.Tensor,
    micro_batch_size: int,
    *,
    num_experts: int,
    use_kept_logp: bool,
    with_routes: bool,
    with_kept_sets: bool,
) -> list[LearnerMicrobatch]:
    """Split ``sample_ids`` into microbatches of up to ``micro_batch_size`` padded rows.

    ``advantages[N]`` are per sample (indexed by the batch's sample id). ``use_kept_logp``
    takes the engine's kept-set-renormalised behaviour log-probs as mu (Keep Sampling Mask).
    """
    out = []
    for start in range(0, len(sample_ids), micro_batch_size):
        ids = [int(i) for i in sample_ids[start : start + micro_batch_size]]
        samples = [batch.sample(i) for i in ids]
        T = max(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
        B = len(samples)
        input_ids = torch.zeros(B, T, dtype=torch.long)
        targets = torch.full((B, T), -1, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.bool)
        valid = torch.zeros(B, T, dtype=torch.bool)
        rollout_logp = torch.zeros(B, T, dtype=torch.float32)
        for b, s in enumerate(samples):
            tokens = torch.from_numpy(np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64))
            n, P, R = len(tokens) - 1, len(s.prompt_ids), len(s.response_ids)
            input_ids[b, :n] = tokens[:-1]
            targets[b, :n] = tokens[1:]
            valid[b, :n] = True
            mask[b, P - 1 : P - 1 + R] = True
            mu = s.sampling_logp if (use_kept_logp and s.sampling_logp is not None) else s.rollout_logp
            rollout_logp[b, P - 1 : P - 1 + R] = torch.from_numpy(np.asarray(mu, np.float32))
        tensors = {
            "input_ids": input_ids,
            "targets": targets,
            "mask": mask,
            "rollout_logp": rollout_logp,
            "advantages": advantages[ids].to(torch.float32),
            "sample_ids": ids,
        }
        outside = 0
        if with_kept_sets and batch.mask_offsets is not None:
            prompt_lens = [len(s.prompt_ids) for s in samples]
            tensors["kept"], outside = _kept_sets(batch, ids, prompt_lens, T)
        routes = None
        if with_routes and batch.routes is not None:
            routes = pack_microbatch_routes([s.routes for s in samples], T, num_experts, first_sample=start)
        out.append(LearnerMicrobatch(tensors, MicrobatchRoutes(ids, valid, routes), outside))
    return out


def minibatch_split(num_samples: int, num_minibatches: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A seeded shuffle of ``range(num_samples)`` cut into ``num_minibatches`` equal parts."""
    if num_samples % num_minibatches:
        raise ValueError(
            f"train.minibatches_per_step={num_minibatches} must divide the {num_samples} samples of a step"
        )
    return np.split(rng.permutation(num_samples), num_minibatches)
