"""A two-turn agent whose trajectories straddle a weight update between their turns, deterministically
(``rollout.agent=tests.exact.straddle_agent:straddle``; async mode, ``rollout.partial: true``, ``max_staleness: 1``,
two steps of ``TRAJECTORIES`` trajectories each, as tests/exact/test_agent_async_e2e.py runs it).

It runs in the trainer's rollout process, where steps 0 and 1 generate at once (the producer starts step 1 once
step 0 has drawn its prompts, on version 0). The order is forced by waits, never by timing:

* step 0's trajectories do both turns, then hold their batch until every step-1 trajectory has done its turn 1.
  Version 1 is pushed only after step 0 is trained, i.e. after its batch is handed over, so every step-1 turn 1 is
  sampled by version 0;
* step 1's trajectories, after turn 1, wait until the server reports version 1 (the push, which a partial-rollout
  push may do while step 1 is in flight), then do turn 2: sampled by version 1.

Turn 2's prompt is the trajectory plus ``ENV`` (three environment tokens), as tests/exact/trajectory_agent.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

from moe_rl.records.versions import parse_version_label
from moe_rl.rollout.turns import Trajectory
from moe_rl.sync.transport import server_weight_version
from tests.exact.trajectory_agent import ENV

TRAJECTORIES = 8  # per step: tests/exact/conftest.py's GATE (2 prompts x 4 samples)
WAIT_S = 300.0  # a wait that lasts this long is a failure of the run under test, said in one line
_cond = threading.Condition()
_past_turn_1: dict[int, int] = {}  # step -> its trajectories that have done turn 1


def _arrived(step: int) -> None:
    with _cond:
        _past_turn_1[step] = _past_turn_1.get(step, 0) + 1
        _cond.notify_all()


def _wait_turn_1(step: int) -> None:
    with _cond:
        if not _cond.wait_for(lambda: _past_turn_1.get(step, 0) >= TRAJECTORIES, timeout=WAIT_S):
            raise RuntimeError(f"straddle_agent: step {step}'s trajectories did not all reach turn 2 in {WAIT_S:g} s")


def _wait_served(addresses, version: int) -> None:
    """Until every server reports ``version`` or newer: a condition that, once true, stays true (not a race)."""
    deadline = time.monotonic() + WAIT_S
    for address in addresses:
        while parse_version_label(server_weight_version(address)).step < version:
            if time.monotonic() > deadline:
                raise RuntimeError(f"straddle_agent: {address} did not serve version {version} in {WAIT_S:g} s")
            time.sleep(0.05)


async def straddle(sample, generate, context) -> Trajectory:
    traj = Trajectory(group_id=sample.group_id)
    first = await generate(traj, sample.prompt_ids)
    step = generate.step
    _arrived(step)
    if step >= 1 and parse_version_label(first.weight_version).step < step:
        await asyncio.to_thread(_wait_served, generate.client.addresses, step)
    await generate(traj, traj.token_ids.tolist() + ENV)
    if step == 0:
        await asyncio.to_thread(_wait_turn_1, 1)
    return traj
