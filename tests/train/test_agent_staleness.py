"""A trajectory whose turns straddle a weight update (async agent rollouts, issue 56 item 1) through the staleness
rules: its generated tokens keep their own versions, its environment tokens (version -1) count nowhere.

Built with the real stitcher (``Trajectory.add_turn``) and records path (``trajectory_sample``,
``RolloutBatch.from_samples``); numbers checked by hand."""

from __future__ import annotations

from moe_rl.records import RolloutBatch
from moe_rl.rollout.turns import Trajectory
from moe_rl.source.agent_batch import trajectory_sample
from moe_rl.train.staleness import StepStaleness
from tests.train.test_agent_samples import _reply


def _straddling(v1: int, v2: int) -> Trajectory:
    """Turn 1 (2 tokens) on version ``v1``, 2 environment tokens, turn 2 (3 tokens) on ``v2``."""
    traj = Trajectory(group_id=1)
    prompt = [1, 2, 3]
    traj.add_turn(prompt, _reply(prompt, [10, 11], 0, v1), traj.plan_turn(prompt))
    prompt2 = traj.token_ids.tolist() + [30, 31]
    start = traj.plan_turn(prompt2)
    traj.add_turn(prompt2, _reply(prompt2, [12, 13, 14], start, v2), start)
    return traj


def test_a_trajectory_straddling_an_update_is_stale_per_token_and_environment_tokens_count_nowhere():
    trajectories = [_straddling(3, 4), _straddling(4, 4)]
    assert [t.versions() for t in trajectories] == [{3, 4}, {4}]
    batch = RolloutBatch.from_samples([trajectory_sample(t) for t in trajectories], num_experts=8)
    batch.validate()
    assert batch.token_versions.tolist() == [3, 3, -1, -1, 4, 4, 4] + [4, 4, -1, -1, 4, 4, 4]
    st = StepStaleness(batch, step=4, width=7, max_staleness=1)
    assert st.rows.tolist() == [[1, 1, 0, 0, 0, 0, 0], [0] * 7]  # environment tokens: no staleness
    assert st.valid[0].tolist() == [True, True, False, False, True, True, True]
    assert not st.dropped.any()
    m = st.metrics()
    assert m["async/partial_frac"] == 0.5 and m["async/staleness_max"] == 1.0
    assert m["async/staleness_mean"] == 2 / 10  # over the 10 generated tokens only
    keep = st.token_keep(0)  # correction.max_token_staleness = 0: turn 1's tokens of the first trajectory go
    assert keep[0, :2].tolist() == [False, False] and keep[0, 4:].all() and keep[1].all()
    assert StepStaleness(batch, step=5, width=7, max_staleness=1).dropped.tolist() == [True, False]  # oldest: 2
