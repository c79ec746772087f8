"""A trajectory as one records sample (``moe_rl.source.agent_batch.trajectory_sample``): the trajectory arrays, the
environment tokens' empty records, every route row, the reward inputs (the last turn, or the agent's own reward)."""

from __future__ import annotations

import numpy as np

from moe_rl.records import RolloutBatch, RolloutSample
from moe_rl.rollout.turns import Trajectory
from moe_rl.source.agent_batch import reward_ids, trajectory_sample


def _reply(prompt, response, start: int, version: int) -> RolloutSample:
    """A turn's reply as the client returns it: route rows from ``start`` on, kept sets, token versions."""
    n = len(prompt) + len(response) - 1 - start
    routes = np.stack([np.arange(2) + (start + t) % 6 for t in range(n)])[:, None, :].astype(np.int32)
    return RolloutSample(
        prompt_ids=np.asarray(prompt, np.int32),
        response_ids=np.asarray(response, np.int32),
        rollout_logp=np.full(len(response), -0.5, np.float32),
        routes=routes,
        sampling_mask=[np.array([t], np.int32) for t in response],
        sampling_logp=np.zeros(len(response), np.float32),
        weight_version=f"step-{version}",
        finish_reason="stop",
        token_versions=np.full(len(response), version, np.int32),
    )


def _two_turns() -> Trajectory:
    traj = Trajectory(group_id=4)
    prompt = [1, 2, 3]
    start = traj.plan_turn(prompt)
    traj.add_turn(prompt, _reply(prompt, [10, 11], start, 2), start)
    prompt2 = traj.token_ids.tolist() + [30, 31]
    start = traj.plan_turn(prompt2)
    traj.add_turn(prompt2, _reply(prompt2, [12, 13, 14], start, 2), start)
    return traj


def test_a_trajectory_becomes_one_records_sample():
    traj = _two_turns()
    s = trajectory_sample(traj)
    assert s.prompt_ids.tolist() == [1, 2, 3] and s.response_ids.tolist() == [10, 11, 30, 31, 12, 13, 14]
    assert s.role_mask.tolist() == s.loss_mask.tolist() == [1, 1, 0, 0, 1, 1, 1]
    assert s.turn_ids.tolist() == [1, 1, 1, 1, 2, 2, 2]
    assert s.rollout_logp.tolist() == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5, -0.5]
    assert s.token_versions.tolist() == [2, 2, -1, -1, 2, 2, 2]
    assert [len(m) for m in s.sampling_mask] == [1, 1, 0, 0, 1, 1, 1]
    np.testing.assert_array_equal(s.routes, traj.routes)
    assert len(s.routes) == 3 + 7 - 1 and (s.group_id, s.weight_version) == (4, "step-2")
    batch = RolloutBatch.from_samples([s, trajectory_sample(_two_turns())], num_experts=8)
    batch.validate()  # the records' trajectory rules hold
    assert reward_ids(s).tolist() == [12, 13, 14]  # the reward function scores the final turn
    assert s.agent_reward is None
    traj.reward = 0.75
    assert trajectory_sample(traj).agent_reward == 0.75
