"""True-on-policy turns have no prefix route conflicts (issue 56 item 3; docs/findings.md): on the session's
true-on-policy server (fp32, patch 0013's kernels) turn 2's prefill recomputes every recorded row of the prefix bit
for bit -- the prompt's rows (prefill of another length) and turn 1's generated rows (decode) alike -- so
``rollout.agent_check_prefix_routes`` counts 0 and the learner's one route per position is the one each turn saw.

In normal mode (bf16 rollout) they do differ; bench/bench_prefix_route_conflicts.py measures how often and what it
does to the learner's log-probs.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from moe_rl.config import load_config
from moe_rl.records import RouteSpec
from moe_rl.rollout.agents import AgentSample, run_agents
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.turns import Trajectory
from tests.exact.conftest import GATE
from tests.exact.trajectory_agent import ENV

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).parents[2]
COUNTER = "replay/turn_prefix_route_conflicts"


class KeepsRecomputedRows(Trajectory):
    """Also keeps the prefix rows turn 2's prefill recomputed (moe_rl counts them against the recorded ones and
    drops them)."""

    def _add_routes(self, rows, start, routes_from):
        if routes_from < start:
            self.marks["recomputed"] = np.array(rows[: start - routes_from])
        super()._add_routes(rows, start, routes_from)


async def two_turns(sample, generate) -> Trajectory:
    traj = KeepsRecomputedRows(group_id=sample.group_id)
    await generate(traj, sample.prompt_ids)
    traj.marks["recorded"] = traj.routes.copy()  # prompt rows (turn 1's prefill) + turn 1's decode rows
    await generate(traj, traj.token_ids.tolist() + ENV)
    return traj


def test_turn_two_prefill_recomputes_the_recorded_prefix_routes_bit_for_bit(tiny_server):
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", GATE)
    sampling = dataclasses.replace(SamplingSettings.from_rollout_config(cfg.rollout), max_new_tokens=4)
    client = RolloutClient(
        [tiny_server], RouteSpec.from_model_config(cfg.model), cfg.model.vocab_size, sampling, seed=cfg.rollout.seed
    )
    rng = np.random.default_rng(56)
    samples = [AgentSample(prompt_ids=rng.integers(8, 40, 6 + g).tolist(), group_id=g) for g in range(3)]
    trajs, counters = asyncio.run(run_agents(two_turns, samples, client, check_prefix_routes=True))
    assert COUNTER in counters, "turn 2 did not compare its prefill's prefix rows with the recorded ones"
    assert counters[COUNTER] == 0
    for traj in trajs:
        recorded, recomputed = traj.marks["recorded"], traj.marks["recomputed"]
        assert len(recorded) == len(traj.segments[0]) + len(traj.segments[1]) - 1 > len(traj.segments[0])
        np.testing.assert_array_equal(recomputed, recorded)  # expert ids in the same order, every layer
        np.testing.assert_array_equal(traj.routes[: len(recorded)], recorded)
