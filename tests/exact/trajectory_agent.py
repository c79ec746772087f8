"""A tiny two-turn agent loop for the trainer's agent path (``rollout.agent=tests.exact.trajectory_agent:two_turns``):
turn 1, three environment tokens (a tool's reply, as tokens of the tiny vocabulary), turn 2."""

from __future__ import annotations

from moe_rl.rollout.turns import Trajectory

ENV = [3, 5, 7]


async def two_turns(sample, generate, context) -> Trajectory:
    traj = Trajectory(group_id=sample.group_id)
    await generate(traj, sample.prompt_ids)
    await generate(traj, traj.token_ids.tolist() + ENV)
    return traj
