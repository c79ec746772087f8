"""Partial agent rollouts (issue 56 item 1): a turn ended by a weight-update pause (``rollout.pause_mode: abort``) is
continued under the new weights, against the session's fp32 SGLang server, and the trajectory stays right.

Interposition (``tests/http_proxy.Proxy``, as tests/rollout/test_request_bound.py), no race: turn 2's first request
(the one sent with ``routed_experts_start_len > 0``) is forwarded with ``max_new_tokens=K``; before its reply goes
back, the proxy pauses the server (``paused_generation``, abort), pushes the second checkpoint as ``step-1`` and
continues it, then hands the reply back as SGLang hands back a running request the pause aborted (``finish_reason``
abort, "Aborted", its K tokens with their log-probs and route rows). The client continues the turn: prompt + those
K tokens, rows from the last of them on, the rest of the budget, under step-1.

Oracle: teacher-forced passes of the whole trajectory under each version. Rows up to the continuation's first
(turn 1's, the boundary row, the environment tokens' and the K tokens' but the last) are step-0's routes, never the
re-prefill's; the rows after are step-1's. Turn 1's rows are the ones turn 1 returned; every generated token keeps
the version that sampled it, and the batch's counters (not the client's) count the continuation.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from moe_rl.rollout.agents import AgentContext, AgentSample, load_agent, run_agents
from moe_rl.rollout.client import RolloutClient
from moe_rl.rollout.partial import PartialCounters, paused_generation
from moe_rl.sync.transport import update_weights_from_disk
from tests.http_proxy import Proxy
from tests.rollout.test_partial_rollouts import _teacher_forced
from tests.rollout.test_turns import ENV, PROMPT, SAMPLING, VOCAB

pytestmark = pytest.mark.sglang

K = 2  # turn 2's tokens before the pause


def test_a_turn_aborted_by_a_weight_update_is_continued_without_touching_earlier_rows(
    sglang_server, route_spec, model_dir, model_dir_v2
):
    url, bodies, cut = sglang_server.url, [], {}

    def request_hook(path, body):
        if path != "/generate":
            return body
        req = json.loads(body)
        req["sampling_params"]["ignore_eos"] = True  # every turn runs its whole budget
        if req.get("routed_experts_start_len", 0) > 0 and not cut:  # turn 2's first request
            req["sampling_params"]["max_new_tokens"] = K
            cut["rid"] = req["rid"]
        bodies.append(req)
        return json.dumps(req).encode()

    def hook(path, body, reply):
        if path != "/generate" or json.loads(body)["rid"] != cut.get("rid"):
            return None
        with paused_generation([url], "abort") as window:  # the update lands while turn 2 is in flight
            update_weights_from_disk([url], model_dir_v2, "step-1", flush_cache=window.flush_cache)
        out = reply.json()
        out["meta_info"]["finish_reason"] = {"type": "abort", "message": "Aborted", "status_code": None}
        return 200, json.dumps(out).encode()

    counters = PartialCounters()
    update_weights_from_disk([url], model_dir, "step-0")
    try:
        with Proxy(url, hook, request_hook) as proxy:
            client = RolloutClient([proxy.url], route_spec, VOCAB, SAMPLING, max_concurrency=1, pause_mode="abort")
            agent = load_agent("tests.rollout.test_turns:two_turns", AgentContext())
            (traj,), metrics = asyncio.run(
                run_agents(agent, [AgentSample(prompt_ids=PROMPT, group_id=5)], client, step=1, counters=counters)
            )
        tokens = traj.token_ids.tolist()
        oracle = {1: _teacher_forced(url, route_spec, PROMPT, tokens[len(PROMPT) :])["routes"]}  # served: step-1
    finally:
        update_weights_from_disk([url], model_dir, "v1")  # the session's checkpoint again: step-0's weights
    oracle[0] = _teacher_forced(url, route_spec, PROMPT, tokens[len(PROMPT) :])["routes"]

    t1, budget = traj.marks["turn1_len"], SAMPLING.max_new_tokens
    turn2_prompt = t1 + len(ENV)
    first, cont = next(b for b in bodies if b["rid"] == cut["rid"]), bodies[-1]
    assert len(bodies) == 3 and first["routed_experts_start_len"] == t1 - 1  # turn 1, turn 2, its continuation
    assert cont["input_ids"] == tokens[: turn2_prompt + K] and cont["routed_experts_start_len"] == turn2_prompt + K - 1
    assert cont["sampling_params"]["max_new_tokens"] == budget - K
    gen1, gen2 = traj.segments[1], traj.segments[3]
    assert [s.role for s in traj.segments] == ["prompt", "generated", "environment", "generated"]
    assert gen1.token_versions.tolist() == [0] * budget
    assert gen2.token_versions.tolist() == [0] * K + [1] * (budget - K) and gen2.weight_version == "step-1"
    assert counters.continued_requests == 1 and counters.partial_samples == 1  # the batch's, not the client's
    assert client.partial_counters.continued_requests == 0
    assert metrics["agent/multi_version_trajectories"] == 1
    # routes: one row per forwarded position; turn 1's rows as turn 1 returned them; each row from its own version
    assert len(traj.routes) == len(traj) - 1
    np.testing.assert_array_equal(traj.routes[: t1 - 1], traj.marks["turn1_routes"])
    split = turn2_prompt + K - 1  # the continuation's first row: the K-th token's, forwarded first under step-1
    rows = np.sort(traj.routes, axis=-1)
    assert (oracle[0][:split] != oracle[1][:split]).any(), "step-1 must route the prefix differently, or no teeth"
    np.testing.assert_array_equal(rows[:split], oracle[0][:split], err_msg="rows before the pause: step-0's")
    np.testing.assert_array_equal(rows[split:], oracle[1][split:], err_msg="rows after the pause: step-1's")
