"""The data plan of one RL step: every sample's minibatch, data-parallel rank and microbatch.

Owns the grouping of a step's ``N`` samples, decided once and consumed by the loop:

- minibatches: a seeded permutation of ``range(N)`` (seed ``(train.seed, step, 1)``) cut into
  ``train.minibatches_per_step`` equal parts. Independent of the data-parallel size, so a
  2-rank run updates on exactly the minibatches a 1-rank run does;
- ranks: minibatch ``m``'s samples are split into ``dp_size`` contiguous shares; rank ``r``
  updates only on share ``r``. Epochs revisit the same minibatches with the same shares, so a
  rank's π_old and R2 routes are computed by that rank for exactly the samples it updates on;
- microbatches: each share is cut into chunks of ``train.micro_batch_size``;
- the old-log-prob pass: a rank scores its shares, minibatch by minibatch (``owned_microbatches``).

No tensors live here; ``moe_rl.train.batching`` turns sample ids into learner tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_rl.config import ConfigError

__all__ = ["MinibatchPlan", "PlanError", "StepPlan", "plan_step"]


class PlanError(ConfigError):
    """A step's samples cannot be split as the config asks (names the keys involved)."""


def _chunks(ids: tuple[int, ...], size: int) -> tuple[tuple[int, ...], ...]:
    return tuple(ids[i : i + size] for i in range(0, len(ids), size))


@dataclass(frozen=True)
class MinibatchPlan:
    """One optimizer step's samples: ``sample_ids`` (all ranks, canonical order) and each rank's share."""

    index: int
    sample_ids: tuple[int, ...]
    shares: tuple[tuple[int, ...], ...]  # shares[r]: the samples rank r updates on (contiguous in sample_ids)
    dp_rank: int
    micro_batch_size: int

    @property
    def local_ids(self) -> tuple[int, ...]:
        """This rank's share."""
        return self.shares[self.dp_rank]

    @property
    def microbatches(self) -> tuple[tuple[int, ...], ...]:
        """This rank's share cut into microbatches of at most ``micro_batch_size`` samples."""
        return _chunks(self.local_ids, self.micro_batch_size)


@dataclass(frozen=True)
class StepPlan:
    """The whole step: ``minibatches`` (in update order) repeated for ``epochs``."""

    num_samples: int
    minibatches: tuple[MinibatchPlan, ...]
    epochs: int
    dp_rank: int
    dp_size: int

    @property
    def owned_ids(self) -> tuple[int, ...]:
        """Every sample this rank updates on, minibatch by minibatch (its old-log-prob pass)."""
        return tuple(i for mb in self.minibatches for i in mb.local_ids)

    @property
    def owned_microbatches(self) -> tuple[tuple[int, ...], ...]:
        """The old-log-prob pass's microbatches: the same cut as the updates."""
        return tuple(m for mb in self.minibatches for m in mb.microbatches)

    def updates(self):
        """``(epoch, minibatch)`` in the order the optimizer steps are taken."""
        for epoch in range(self.epochs):
            for mb in self.minibatches:
                yield epoch, mb


def plan_step(
    num_samples: int,
    *,
    minibatches: int,
    micro_batch_size: int,
    epochs: int = 1,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
    step: int = 0,
) -> StepPlan:
    """Plan step ``step`` of ``num_samples`` samples (see the module docstring for the rules)."""
    if num_samples < 1:
        raise PlanError(f"a step needs at least one sample; got {num_samples}")
    if micro_batch_size < 1:
        raise PlanError(f"train.micro_batch_size must be >= 1; got {micro_batch_size}")
    if not 0 <= dp_rank < dp_size:
        raise PlanError(f"data-parallel rank {dp_rank} is outside [0, {dp_size})")
    if minibatches < 1 or num_samples % minibatches:
        raise PlanError(
            f"train.minibatches_per_step={minibatches} must divide the step's {num_samples} samples "
            "(train.prompts_per_step x rollout.samples_per_prompt)"
        )
    per_minibatch = num_samples // minibatches
    if per_minibatch % dp_size:
        raise PlanError(
            f"each minibatch has {per_minibatch} samples (train.prompts_per_step x rollout.samples_per_prompt / "
            f"train.minibatches_per_step), which the {dp_size} data-parallel ranks cannot share equally; "
            f"make it a multiple of {dp_size}"
        )
    order = np.random.default_rng([seed, step, 1]).permutation(num_samples)
    share = per_minibatch // dp_size
    plans = []
    for m in range(minibatches):
        ids = tuple(int(i) for i in order[m * per_minibatch : (m + 1) * per_minibatch])
        shares = tuple(ids[r * share : (r + 1) * share] for r in range(dp_size))
        plans.append(MinibatchPlan(m, ids, shares, dp_rank, micro_batch_size))
    return StepPlan(num_samples, tuple(plans), epochs, dp_rank, dp_size)
