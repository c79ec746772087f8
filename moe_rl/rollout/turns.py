"""Multi-turn trajectories: segments of model-generated and environment tokens, stitched turn by turn.

Owns the ``Trajectory`` (issue 56; stored as records by ``moe_rl.source.agent_batch``, format 4) and the
rules that keep its routes right across turns (docs/agents.md, "Routing across turns"):

* Token ids are stitched by the **actual shared prefix** of the trajectory so far and the next turn's prompt,
  never by length. A prompt that changes earlier tokens (a chat template that re-renders the history) is a
  ``TemplateRerenderError`` (``rerender="refuse"``), or (``"retokenize"``) the trajectory is cut back to the
  shared prefix, marked and counted (``agent/template_rerenders``, ``agent/rerender_dropped_tokens``).
* Each turn after the first asks SGLang for route rows from ``start = previous length - 1`` (the client's
  ``routes_start_len``): the reply brings the new rows plus the **boundary row** -- the route of the previous
  turn's last token, which no earlier forward computed; it is the one turn k+1's prefill computed, never padding.
* Rows already recorded are never overwritten. With ``check_prefix_routes`` the turn asks for every row, compares
  the prefill's recomputed prefix rows with the recorded ones (as expert sets) and counts the positions that differ
  (``replay/turn_prefix_route_conflicts``); the recorded rows are kept.
* Per token: a role mask (1 = model-generated) and a loss mask (environment and prompt tokens never train);
  log-probs, kept sets and weight versions exist for generated tokens only (``Segment``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from moe_rl.records import RolloutSample
from moe_rl.rollout.client import RolloutClient, sample_seed
from moe_rl.rollout.dispatch import Group
from moe_rl.rollout.partial import PartialCounters

__all__ = [
    "RERENDER_MODES",
    "Segment",
    "TemplateRerenderError",
    "Trajectory",
    "TurnGenerate",
    "route_conflicts",
    "shared_prefix_len",
]

Role = Literal["prompt", "generated", "environment"]
RERENDER_MODES = ("refuse", "retokenize")


class TemplateRerenderError(ValueError):
    """A turn's prompt changes tokens of the trajectory so far (a re-rendered chat template); names the position."""


@dataclass
class Segment:
    """A run of tokens of one role. Generated segments carry what the rollout recorded per token."""

    role: Role
    token_ids: np.ndarray  # int32 [n]
    turn: int  # the turn that generated it, or the turn whose prompt added it
    logp: np.ndarray | None = None  # float32 [n] behaviour log-probs (generated only)
    sampling_mask: list[np.ndarray] | None = None  # n kept sets (generated only)
    sampling_logp: np.ndarray | None = None
    token_versions: np.ndarray | None = None  # int32 [n]
    weight_version: str = ""
    finish_reason: str = ""

    def __len__(self) -> int:
        return len(self.token_ids)

    def head(self, n: int) -> Segment:
        """The first ``n`` tokens of this segment with their per-token records."""
        cut = lambda a: None if a is None else a[:n]
        return Segment(
            self.role,
            self.token_ids[:n],
            self.turn,
            cut(self.logp),
            cut(self.sampling_mask),
            cut(self.sampling_logp),
            cut(self.token_versions),
            self.weight_version,
            self.finish_reason,
        )


def shared_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def route_conflicts(recorded: np.ndarray, recomputed: np.ndarray) -> int:
    """Positions whose expert set differs in any MoE layer (top-k order ignored): ``[n, L, K]`` each."""
    return int((np.sort(recorded, axis=-1) != np.sort(recomputed, axis=-1)).any(axis=(1, 2)).sum())


@dataclass
class Trajectory:
    """One multi-turn rollout: segments back to back, the route rows of every forwarded position, counters.

    ``routes`` has ``len(token_ids) - 1`` rows once a turn is recorded (row i: the route of token i as an input);
    ``reward`` / ``turn_rewards`` are the agent's; ``marks`` holds why it ended and any re-render mark.
    """

    group_id: int = 0
    segments: list[Segment] = field(default_factory=list)
    routes: np.ndarray | None = None
    reward: float | None = None
    turn_rewards: list[float] = field(default_factory=list)
    marks: dict = field(default_factory=dict)
    metrics: Counter = field(default_factory=Counter)
    turns: int = 0
    server: int | None = None  # the client's index of the server its turns go to (its first turn's placement)

    # ---------------------------------------------------------------- views
    @property
    def token_ids(self) -> np.ndarray:
        if not self.segments:
            return np.zeros(0, np.int32)
        return np.concatenate([s.token_ids for s in self.segments]).astype(np.int32)

    def __len__(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def role_mask(self) -> np.ndarray:
        """int8 per token: 1 = generated by the model, 0 = prompt or environment."""
        return np.concatenate([np.full(len(s), s.role == "generated", np.int8) for s in self.segments])

    @property
    def loss_mask(self) -> np.ndarray:
        """float32 per token: 1 where the loss applies (generated tokens only)."""
        return self.role_mask.astype(np.float32)

    @property
    def turn_ids(self) -> np.ndarray:
        """int32 per token: the turn of its segment."""
        return np.concatenate([np.full(len(s), s.turn, np.int32) for s in self.segments])

    @property
    def generated_tokens(self) -> int:
        return sum(len(s) for s in self.segments if s.role == "generated")

    def versions(self) -> set:
        """The weight versions its generated tokens came from (per-token versions; else each turn's label)."""
        out: set = set()
        for s in self.segments:
            if s.role == "generated":
                out |= {s.weight_version} if s.token_versions is None else {int(v) for v in s.token_versions}
        return out

    def last_generated(self) -> Segment | None:
        return next((s for s in reversed(self.segments) if s.role == "generated"), None)

    # ---------------------------------------------------------------- stitching
    def plan_turn(self, prompt_ids, rerender: str = "refuse") -> int:
        """Check the next turn's prompt against the trajectory so far and return its ``routes_start_len``.

        A prompt that shares fewer tokens than the trajectory holds is a re-render: refused, or (``retokenize``)
        the trajectory is cut back to the shared prefix (the dropped generated tokens counted and marked)."""
        if rerender not in RERENDER_MODES:
            raise ValueError(f"rollout.agent_rerender={rerender!r}; expected one of {RERENDER_MODES}")
        prompt_ids = np.asarray(prompt_ids, np.int32)
        if not self.segments:
            return 0
        have = self.token_ids
        shared = shared_prefix_len(have, prompt_ids)
        if shared < len(have):
            self.metrics["agent/template_rerenders"] += 1
            if rerender == "refuse":
                got = prompt_ids[shared] if shared < len(prompt_ids) else "<end>"
                raise TemplateRerenderError(
                    f"turn {self.turns + 1}'s prompt differs from the trajectory at token {shared} of {len(have)} "
                    f"(trajectory has {int(have[shared])}, prompt has {got}): the chat template re-rendered earlier "
                    "turns; build the next prompt as trajectory.token_ids + new tokens, or set "
                    "rollout.agent_rerender=retokenize"
                )
            self._cut(shared)
            return shared  # rows [0, shared) are still valid: their tokens and every token before them are unchanged
        return len(have) - 1  # the boundary row: the previous turn's last token was never forwarded

    def _cut(self, n: int) -> None:
        kept, total, dropped = [], 0, 0
        for seg in self.segments:
            take = max(0, min(len(seg), n - total))
            if seg.role == "generated":
                dropped += len(seg) - take
            if take:
                kept.append(seg if take == len(seg) else seg.head(take))
            total += len(seg)
        self.segments = kept
        self.routes = None if self.routes is None else self.routes[:n]
        self.metrics["agent/rerender_dropped_tokens"] += dropped
        self.marks["rerendered"] = True

    def add_turn(self, prompt_ids, sample: RolloutSample, start: int, routes_from: int | None = None) -> Segment:
        """Record one turn: ``prompt_ids`` (already checked by ``plan_turn``, which returned ``start``) and the
        reply ``sample``, whose route rows begin at ``routes_from`` (default ``start``; 0 when the prefix rows were
        asked for to count conflicts). Returns the generated segment."""
        prompt_ids = np.asarray(prompt_ids, np.int32)
        if not np.array_equal(np.asarray(sample.prompt_ids), prompt_ids):
            raise ValueError("the reply's prompt is not the turn's prompt")
        have, routes_from = len(self), start if routes_from is None else routes_from
        if prompt_ids[:have].tolist() != self.token_ids.tolist():
            raise ValueError("add_turn before plan_turn: the prompt does not extend the trajectory")
        new = prompt_ids[have:]
        if len(new) or not self.segments:
            self.segments.append(Segment("prompt" if not self.segments else "environment", new, self.turns))
        self.turns += 1
        gen = Segment(
            "generated",
            np.asarray(sample.response_ids, np.int32),
            self.turns,
            np.asarray(sample.rollout_logp, np.float32),
            sample.sampling_mask,
            sample.sampling_logp,
            sample.token_versions,
            sample.weight_version,
            sample.finish_reason,
        )
        self.segments.append(gen)
        if sample.routes is not None:
            self._add_routes(sample.routes, start, routes_from)
        return gen

    def _add_routes(self, rows: np.ndarray, start: int, routes_from: int) -> None:
        known = 0 if self.routes is None else len(self.routes)
        if known != start:
            raise ValueError(f"the trajectory holds {known} route rows; the turn's rows start at {start}")
        if routes_from < start:  # the prefill's recomputation of recorded rows: compared, never stored
            self.metrics["replay/turn_prefix_route_conflicts"] += route_conflicts(
                self.routes[routes_from:start], rows[: start - routes_from]
            )
            rows = rows[start - routes_from :]
        self.routes = rows if self.routes is None else np.concatenate([self.routes, rows])
        if len(self.routes) != len(self) - 1:
            raise ValueError(f"{len(self.routes)} route rows for {len(self)} tokens; expected one per forwarded token")


class TurnGenerate:
    """The async generate handle an agent loop receives: one call = one turn of one trajectory.

    ``await generate(trajectory, prompt_ids, max_new_tokens=None)`` checks the prompt against the trajectory
    (``Trajectory.plan_turn``), requests only the new route rows (``routes_start_len``; every row with
    ``check_prefix_routes``), records the turn and returns its generated segment. Each turn has its own
    sampling seed, derived from the sample's ``(seed, step, group, index)`` and the turn number. ``counters``: where
    the turns' ``async/*`` counts go (a batch's own in async mode; default: the client's). In partial-rollout mode a
    turn ended by a weight-update pause is continued by the client like any request (``moe_rl.rollout.partial``):
    the continuation asks only for rows from its own prompt's last token on, so the turn still returns exactly
    rows ``[routes_start_len, ...)`` and the trajectory's earlier rows are untouched; its tokens keep the version
    that sampled each of them.
    """

    def __init__(
        self,
        client: RolloutClient,
        *,
        step: int = 0,
        index: int = 0,
        rerender: str = "refuse",
        check_prefix_routes: bool = False,
        seeded: bool = True,
        counters: PartialCounters | None = None,
    ):
        if rerender not in RERENDER_MODES:
            raise ValueError(f"rollout.agent_rerender={rerender!r}; expected one of {RERENDER_MODES}")
        self.client, self.step, self.index = client, step, index
        self.rerender, self.check_prefix_routes, self.seeded = rerender, check_prefix_routes, seeded
        self.counters = counters

    def turn_seed(self, group_id: int, turn: int) -> int:
        base = sample_seed(self.client.seed, self.step, group_id, self.index)
        return int(np.random.SeedSequence([base, 1 + turn]).generate_state(1, np.uint32)[0])

    async def __call__(self, trajectory: Trajectory, prompt_ids, max_new_tokens: int | None = None) -> Segment:
        start = trajectory.plan_turn(prompt_ids, self.rerender)
        prompt_ids = np.asarray(prompt_ids, np.int32)
        ask_from = 0 if self.check_prefix_routes else start
        budget = self.client.sampling.max_new_tokens  # a turn asks for at most this (and at most what is left)
        budget = max(1, min(int(max_new_tokens or budget), budget))
        group = Group(len(prompt_ids) + budget, 1, prefer=trajectory.server)  # later turns: the first turn's server
        (sample,) = await self.client.agenerate(
            [prompt_ids],
            1,
            group_ids=[trajectory.group_id],
            step=self.step,
            seeded=self.seeded,
            routes_start_len=[ask_from],
            seeds=[self.turn_seed(trajectory.group_id, trajectory.turns)],
            max_new_tokens=[budget],
            groups=[group],
            counters=self.counters,
        )
        trajectory.server = group.home
        return trajectory.add_turn(prompt_ids, sample, start, routes_from=ask_from)
