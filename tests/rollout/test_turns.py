"""Multi-turn trajectories against the session's fp32 SGLang server: routes stay right across turns.

Each trajectory is two turns of a function agent (``rollout.agent``'s function form) through ``run_agents``:
turn 1, a few environment tokens, turn 2 asking only for the new route rows (``routes_start_len``).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moe_rl.rollout.agents import AgentContext, AgentSample, load_agent, run_agents
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.turns import TemplateRerenderError, Trajectory, TurnGenerate
from moe_rl.sync.transport import update_weights_from_disk

pytestmark = pytest.mark.sglang

VOCAB = 512
SAMPLING = SamplingSettings(temperature=0.8, top_p=0.9, top_k=16, max_new_tokens=6)
PROMPT = [5, 17, 99, 250, 7, 31]
ENV = [400, 12, 3, 88]  # a tool's reply, as tokens


async def two_turns(sample: AgentSample, generate: TurnGenerate, context: AgentContext) -> Trajectory:
    """Turn 1, the environment's tokens, turn 2; ``sample.extra`` carries the test's hooks: ``between`` (called
    after turn 1), ``change_prefix`` (a turn-2 prompt that changes an earlier token) and ``turn2_max`` (turn 2's
    max_new_tokens)."""
    traj = Trajectory(group_id=sample.group_id)
    await generate(traj, sample.prompt_ids)
    traj.marks["turn1_routes"] = traj.routes.copy()
    traj.marks["turn1_len"] = len(traj)
    sample.extra.get("between", lambda: None)()
    prompt = traj.token_ids.tolist() + ENV
    if sample.extra.get("change_prefix"):
        prompt[2] += 1  # a re-rendered template: an earlier token changed, the length unchanged
    await generate(traj, prompt, max_new_tokens=sample.extra.get("turn2_max"))
    return traj


def _run(url, route_spec, *, check_prefix_routes=False, rerender="refuse", **hooks):
    client = RolloutClient([url], route_spec, VOCAB, SAMPLING, max_concurrency=1)
    agent = load_agent("tests.rollout.test_turns:two_turns", AgentContext())
    sample = AgentSample(prompt_ids=PROMPT, group_id=3, extra=hooks)
    (traj,), metrics = asyncio.run(
        run_agents(agent, [sample], client, step=2, rerender=rerender, check_prefix_routes=check_prefix_routes)
    )
    return client, traj, metrics


def _scratch(client, traj):
    """A from-scratch request for the whole of turn 2's prompt, with turn 2's seed: every route row at once."""
    gen = traj.segments[-1]
    prompt = traj.token_ids[: len(traj) - len(gen)]
    seed = TurnGenerate(client, step=2).turn_seed(traj.group_id, 1)
    (out,) = asyncio.run(
        client.agenerate([prompt], 1, group_ids=[traj.group_id], seeds=[seed], max_new_tokens=[len(gen)])
    )
    np.testing.assert_array_equal(out.response_ids, gen.token_ids)  # same seed, same weights: same turn
    return out


def test_a_two_turn_trajectory_has_every_route_row_of_a_from_scratch_request_and_the_real_boundary_row(
    sglang_server, route_spec
):
    client, traj, metrics = _run(sglang_server.url, route_spec, check_prefix_routes=True)
    t1 = traj.marks["turn1_len"]
    assert [s.role for s in traj.segments] == ["prompt", "generated", "environment", "generated"]
    assert len(traj.routes) == len(traj) - 1
    np.testing.assert_array_equal(traj.routes[: t1 - 1], traj.marks["turn1_routes"])
    scratch = _scratch(client, traj)
    # fp32, deterministic: prefill and decode route alike, so the stitched rows are exactly the one-request rows;
    # row t1 - 1 is the boundary (turn 1's last token, forwarded first by turn 2's prefill): a real route
    np.testing.assert_array_equal(traj.routes[t1 - 1], scratch.routes[t1 - 1])
    np.testing.assert_array_equal(traj.routes, scratch.routes)
    assert metrics["replay/turn_prefix_route_conflicts"] == 0
    np.testing.assert_array_equal(
        traj.role_mask, np.r_[np.zeros(6), np.ones(t1 - 6), np.zeros(4), np.ones(len(traj.segments[3]))]
    )
    assert traj.loss_mask.sum() == traj.generated_tokens


def test_turn_one_rows_survive_a_weight_update_before_turn_two_and_conflicts_are_counted(
    sglang_server, route_spec, model_dir, model_dir_v2
):
    url = sglang_server.url
    try:
        client, traj, metrics = _run(
            url,
            route_spec,
            check_prefix_routes=True,
            between=lambda: update_weights_from_disk([url], model_dir_v2, "v2"),
            turn2_max=3,
        )
        scratch = _scratch(client, traj)  # under v2, like turn 2
    finally:
        update_weights_from_disk([url], model_dir, "v1")
    t1 = traj.marks["turn1_len"]
    assert len(traj.segments[3]) <= 3, "the turn's own max_new_tokens"
    assert traj.segments[1].weight_version != "v2" and traj.segments[3].weight_version == "v2"
    # turn 2's prefill (v2) recomputed the prefix with other routes; the trajectory keeps turn 1's own (v1) rows
    differing = (np.sort(scratch.routes[: t1 - 1], -1) != np.sort(traj.marks["turn1_routes"], -1)).any(axis=(1, 2))
    assert differing.sum() > 0, "v2 must route some prefix token differently, or this test proves nothing"
    np.testing.assert_array_equal(traj.routes[: t1 - 1], traj.marks["turn1_routes"])
    assert metrics["replay/turn_prefix_route_conflicts"] == differing.sum()
    np.testing.assert_array_equal(traj.routes[t1 - 1 :], scratch.routes[t1 - 1 :])  # boundary and turn 2: v2's


def test_a_rerendered_prefix_is_refused_or_cut_back_marked_and_counted(sglang_server, route_spec):
    with pytest.raises(TemplateRerenderError, match="differs from the trajectory at token 2 of"):
        _run(sglang_server.url, route_spec, change_prefix=True)
    client, traj, metrics = _run(sglang_server.url, route_spec, rerender="retokenize", change_prefix=True)
    assert metrics["agent/template_rerenders"] == 1 and traj.marks["rerendered"]
    assert metrics["agent/rerender_dropped_tokens"] == traj.marks["turn1_len"] - len(PROMPT)
    assert [s.role for s in traj.segments] == ["prompt", "environment", "generated"]
    assert traj.token_ids[2] == PROMPT[2] + 1
    np.testing.assert_array_equal(traj.routes[:2], traj.marks["turn1_routes"][:2])  # rows before the change stand
    np.testing.assert_array_equal(traj.routes, _scratch(client, traj).routes)
