"""Which generated groups a step trains on: DAPO dynamic sampling (``train.filter_groups``).

Owns the collection of one step's groups over generation rounds. A group (one prompt's
``rollout.samples_per_prompt`` samples) whose rewards are all equal has zero GRPO advantage and carries
no signal (DAPO, Yu et al. 2025, "Dynamic Sampling"; verl ``algorithm.filter_groups`` keeps groups
whose metric has std > 0, regenerating until ``train_batch_size`` prompts are kept or
``max_num_gen_batches`` is reached; slime ``check_reward_nonzero_std``). Rounds generate
``prompts_per_step`` prompts each; the first ``prompts_per_step`` informative groups in generation
order are kept, so the step plan keeps its fixed shape. When ``max_generation_rounds`` is reached
first the step fails naming the rounds and the informative fraction, or with
``train.filter_groups_fallback`` the batch is filled with dropped groups in generation order (all of
them are equally uninformative: each has zero reward variance) and the number is logged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Collected", "FilterError", "GroupRound", "collect_groups", "informative_groups"]


class FilterError(RuntimeError):
    """Dynamic sampling ran out of generation rounds before enough informative groups were found."""


def informative_groups(rewards, group_size: int) -> np.ndarray:
    """``keep[G]``: groups of ``group_size`` consecutive rewards that are not all equal."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    return r.max(axis=1) > r.min(axis=1)


@dataclass
class GroupRound:
    """One generation round: its prompts and ``len(prompts) * group_size`` samples, rewards in sample order."""

    prompts: list
    samples: list
    rewards: list[float]


@dataclass
class Collected:
    prompts: list = field(default_factory=list)  # one per kept group
    samples: list = field(default_factory=list)  # group_size per kept group, in order
    rewards: list[float] = field(default_factory=list)
    rounds: int = 0
    groups_seen: int = 0
    groups_informative: int = 0
    groups_filled: int = 0  # dropped groups put back by the fallback

    @property
    def informative_frac(self) -> float:
        return self.groups_informative / max(self.groups_seen, 1)

    def add(self, prompt, samples: list, rewards: list[float]) -> None:
        """Keep one group (its prompt, its samples and their rewards)."""
        self.prompts.append(prompt)
        self.samples.extend(samples)
        self.rewards.extend(rewards)

    def metrics(self) -> dict[str, float]:
        return {
            "filter/rounds": float(self.rounds),
            "filter/groups_seen": float(self.groups_seen),
            "filter/informative_frac": self.informative_frac,
            "filter/fallback_groups": float(self.groups_filled),
        }


def collect_groups(
    generate: Callable[[int], GroupRound], want: int, group_size: int, max_rounds: int, fallback: bool = False
) -> Collected:
    """Call ``generate(round)`` until ``want`` informative groups are kept (module docstring)."""
    out, dropped = Collected(), []
    while len(out.prompts) < want:
        if out.rounds == max_rounds:
            if not fallback:
                raise FilterError(
                    f"train.filter_groups: {out.groups_informative} informative groups of {out.groups_seen} "
                    f"({out.informative_frac:.0%}) after train.max_generation_rounds={max_rounds} rounds; {want} are needed "
                    "(train.prompts_per_step). Raise train.max_generation_rounds, set "
                    "train.filter_groups_fallback=true to fill the batch with dropped groups, or check the rewards"
                )
            for group in dropped[: want - len(out.prompts)]:
                out.add(*group)
                out.groups_filled += 1
            break
        got = generate(out.rounds)
        out.rounds += 1
        keep = informative_groups(got.rewards, group_size)
        out.groups_seen += len(keep)
        out.groups_informative += int(keep.sum())
        for g, ok in enumerate(keep):
            group = (
                got.prompts[g],
                got.samples[g * group_size : (g + 1) * group_size],
                got.rewards[g * group_size : (g + 1) * group_size],
            )
            if not ok:
                dropped.append(group)
            elif len(out.prompts) < want:
                out.add(*group)
    return out
