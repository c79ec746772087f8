"""Async agent rollouts with a weight update between turns (issue 56 item 1, its async "Show"): exact per version.

One ``moe-rl train`` run, 2 steps, async (``max_staleness: 1``) with partial rollouts (the push pauses the batch in
flight instead of waiting for it), under the exact gate's fp32 true-on-policy settings (tests/exact/conftest.py) on
the session's true-on-policy server, with ``tests/exact/straddle_agent.py``: step 1's trajectories do turn 1 on
version 0 and turn 2 on version 1, forced by waits (the agent's docstring), not by timing. The run completes, and
every step-1 trajectory carries both versions: turn 1's tokens 0, turn 2's 1, the environment tokens none.

The oracle: each turn recomputed offline by the learner at the version that generated it (the initial model, or
the step-1 checkpoint: the weights pushed as version 1), on the prefix as that turn saw it (the trajectory up to the
turn's last token). Every generated token's log-prob is bit-equal to the recorded one, and every route row equals
that version's natural top-k: row ``j`` belongs to the turn of the next generated token after position ``j`` (the
forward in which token ``j`` was first an input: a turn's prefill covers its prompt, the environment tokens and the
boundary row of the previous turn's last token).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_rl.records import RolloutBatch
from moe_rl.records.summary import batch_summary
from tests.exact.straddle_agent import TRAJECTORIES
from tests.exact.test_true_on_policy_e2e import _policy, _recompute, _train

pytestmark = pytest.mark.sglang

AGENT = "rollout.agent=tests.exact.straddle_agent:straddle"
ASYNC = [
    "train.rollout_mode=async",
    "train.max_staleness=1",
    "rollout.partial=true",
    "checkpoint.save_interval=1",  # the step-1 checkpoint holds version 1 (the oracle's weights)
    "rollout.max_new_tokens=4",  # tiny_cpu's own (tests/exact/test_agent_exact_e2e.py)
]


@pytest.fixture(scope="module")
def straddle_run(tmp_path_factory, tiny_server):
    out = tmp_path_factory.mktemp("agent_async")
    return out, _train(out, "tiny_cpu.yaml", f"rollout.addresses=[{tiny_server}]", AGENT, *ASYNC)


def row_turns(sample) -> np.ndarray:
    """Per route row ``j`` (``P + R - 1`` of them): the response index of the next generated token after position
    ``j`` -- the token whose sampling forward first took token ``j`` as an input."""
    P, role = len(sample.prompt_ids), np.asarray(sample.role_mask)
    gen = np.flatnonzero(role == 1)
    rows = np.arange(P + len(role) - 1)
    return gen[np.searchsorted(gen, rows + 1 - P)]


def test_async_agent_run_completes_with_trajectories_spanning_two_versions(straddle_run):
    out, metrics = straddle_run
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["agent/trajectories"] == TRAJECTORIES and m["agent/turns_mean"] == 2.0 for m in metrics)
    assert metrics[0]["agent/multi_version_trajectories"] == 0.0
    assert metrics[1]["agent/multi_version_trajectories"] == TRAJECTORIES
    assert metrics[1]["async/partial_frac"] == 1.0 and metrics[1]["async/staleness_max"] == 1.0
    batch = RolloutBatch.load(out / "rollouts" / "step_000001.safetensors")
    summary = batch_summary(batch)
    assert summary["partial_samples"] == TRAJECTORIES and summary["token_versions"] == [0, 1]
    for s in batch.samples():
        gen = s.role_mask == 1
        assert (s.token_versions[~gen] == -1).all() and s.weight_version.startswith("step-1")
        assert (s.token_versions[gen & (s.turn_ids == 1)] == 0).all() and (s.turn_ids == 1).any()
        assert (s.token_versions[gen & (s.turn_ids == 2)] == 1).all() and (gen & (s.turn_ids == 2)).any()


def test_each_turn_recomputed_at_its_own_version_on_its_prefix_is_bit_equal(straddle_run, megatron_world):
    out, _ = straddle_run
    policies = {}
    for step in (0, 1):
        for s in RolloutBatch.load(out / "rollouts" / f"step_{step:06d}.safetensors").samples():
            P, role, versions = len(s.prompt_ids), np.asarray(s.role_mask), np.asarray(s.token_versions)
            routes = torch.as_tensor(s.routes.astype("int64")).sort(-1).values
            owner = row_turns(s)
            for turn in np.unique(s.turn_ids):
                mine = np.flatnonzero((s.turn_ids == turn) & (role == 1))  # the turn's generated tokens
                (v,) = set(versions[mine].tolist())  # one version per turn (no pause inside a turn here)
                if v not in policies:
                    policies[v] = _policy(out, v)
                model, temperature = policies[v]
                end = int(mine[-1]) + 1
                prefix = SimpleNamespace(prompt_ids=s.prompt_ids, response_ids=s.response_ids[:end])
                logp, top = _recompute(model, prefix, temperature)  # the turn's prompt and its tokens, nothing after
                recorded = torch.as_tensor(s.rollout_logp[mine], dtype=torch.float32)
                assert torch.equal(logp[mine], recorded), (step, s.group_id, turn, v)
                rows = np.flatnonzero(np.isin(owner, mine))  # the rows this turn's forwards computed
                assert rows.size and rows.max() < P + end - 1
                assert torch.equal(top[rows], routes[rows]), (step, s.group_id, turn, v)
    assert sorted(policies) == [0, 1]


def test_row_turns_assigns_the_boundary_and_environment_rows_to_the_next_turn():
    # turn 1: 2 tokens, 2 environment tokens, turn 2: 2 tokens
    s = SimpleNamespace(prompt_ids=np.array([1, 2, 3]), role_mask=np.array([1, 1, 0, 0, 1, 1], np.uint8))

    # rows 0..7: prompt rows 0-1 -> response token 0; row 2 (prompt's last) -> 0; row 3 -> 1; rows 4-6 (turn 1's last
    # token = the boundary row, then the environment tokens) -> 4 (turn 2's first token); row 7 -> 5
    assert row_turns(s).tolist() == [0, 0, 0, 1, 4, 4, 4, 5]
