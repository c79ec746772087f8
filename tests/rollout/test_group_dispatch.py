"""A group's samples go to one server, groups balanced by load (``moe_rl.rollout.dispatch``; issue 53 item 2).

The placement rules on a ``Dispatch`` alone, then two real SGLang servers (the session's ``sglang_server`` and
``tiny_cpu_server``, each behind a recording ``tests/http_proxy.Proxy``): every request of a group reaches one
server, and both servers get groups. The proxies only record; where a request goes is decided by the client.
"""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from moe_rl.rollout.agents import AgentSample, run_agents
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.dispatch import Dispatch, Group
from moe_rl.rollout.turns import Trajectory
from tests.exact.trajectory_agent import ENV
from tests.http_proxy import Proxy


def test_a_group_is_placed_on_the_server_with_the_fewest_outstanding_tokens():
    d = Dispatch(2)
    a, b = Group(tokens=10, pending=4), Group(tokens=10, pending=4)
    assert (d.place(a), d.place(b)) == (0, 1), "ties in rotation order, then the emptier server"
    assert d.place(a) == 0 and d.tokens == [40, 40], "a placed group keeps its home; its samples' tokens count once"
    big = Group(tokens=100, pending=1)
    d.sample_done(a)  # a: 3 samples left on server 0
    assert d.place(big) == 0 and d.tokens == [130, 40]
    assert d.place(Group(tokens=1, pending=1)) == 1, "the server with fewer outstanding tokens"
    assert d.order(0)[0] == 0 and sorted(d.order(0)) == [0, 1], "home first, then the rest"
    for _ in range(3):
        d.sample_done(a)
    d.sample_done(big)
    assert d.tokens == [0, 41]


def test_round_robin_places_groups_in_turn_and_one_server_takes_everything():
    rr = Dispatch(3, "round_robin")
    rr.tokens = [0, 99, 0]
    assert [rr.place(Group(1, 1)) for _ in range(3)] == [0, 1, 2], "round robin ignores the load"
    one = Dispatch(1)
    assert {one.place(Group(5, 2)) for _ in range(4)} == {0} and one.order() == [0]
    with pytest.raises(ValueError, match="load_balance='busiest'"):
        Dispatch(2, "busiest")


def test_a_preferred_server_is_used_whatever_its_load_and_counts_the_group():
    d = Dispatch(2)
    d.tokens = [100, 0]
    assert d.place(Group(tokens=5, pending=1, prefer=0)) == 0 and d.tokens == [105, 0]
    assert d.place(Group(tokens=5, pending=1)) == 1, "no preference: by load"
    assert d.place(Group(tokens=5, pending=1, prefer=7)) == 1, "a server index the client lacks is ignored"


def test_a_cancelled_sample_of_an_unplaced_group_leaves_no_load_behind():
    d, g = Dispatch(2), Group(tokens=7, pending=3)
    d.sample_done(g)  # cancelled before any sample of the group took a slot
    d.place(g)
    d.sample_done(g)
    d.sample_done(g)
    assert d.tokens == [0, 0] and g.pending == 0


def _servers_of(seen: dict[str, list[tuple[int, ...]]]) -> dict[tuple[int, ...], set[str]]:
    """Each recorded prompt -> the proxies (servers) it reached."""
    servers: dict[tuple[int, ...], set[str]] = {}
    for name, sent in seen.items():
        for prompt in sent:
            servers.setdefault(prompt, set()).add(name)
    return servers


@pytest.mark.sglang
def test_each_group_lands_on_one_server_and_both_servers_are_used(sglang_server, tiny_cpu_server):
    """6 prompts x 3 samples, every request admitted at once (max_concurrency 18): the groups are placed before any
    reply, so the outstanding-token balance alternates them; each proxy records the prompts it forwarded."""
    seen: dict[str, list[tuple[int, ...]]] = {"a": [], "b": []}
    lock = threading.Lock()

    def recorder(name):
        def hook(path, body, reply):
            if path == "/generate":
                with lock:
                    seen[name].append(tuple(json.loads(body)["input_ids"]))

        return hook

    prompts = [[1 + g, 2, 3, 4 + g] for g in range(6)]  # ids < 64: both models' vocabularies
    with Proxy(sglang_server.url, recorder("a")) as a, Proxy(tiny_cpu_server, recorder("b")) as b:
        client = RolloutClient(
            [a.url, b.url],
            None,
            512,
            SamplingSettings(max_new_tokens=3),
            return_sampling_mask=False,
            max_concurrency=18,
        )
        samples = client.generate(prompts, n=3)
    assert len(samples) == 18 and len(seen["a"]) + len(seen["b"]) == 18
    home = _servers_of(seen)
    assert all(len(servers) == 1 for servers in home.values()), f"a group's samples were split: {home}"
    per_server = {name: len(set(sent)) for name, sent in seen.items()}
    assert per_server == {"a": 3, "b": 3}, f"groups per server: {per_server}"
    assert client.dispatch.tokens == [0, 0] and client.dispatch.in_flight == [0, 0]


@pytest.mark.sglang
def test_an_agent_trajectorys_turns_stay_on_its_first_turns_server(sglang_server, tiny_cpu_server):
    """4 two-turn trajectories (turn 1, 3 environment tokens, turn 2), one after another over two servers. Each turn
    is its own call (n=1), so only the pin (``Group.prefer`` = the trajectory's ``server``) keeps turn 2 on turn 1's
    server, where its prefix is cached. Between its turns the agent makes its own server look the busiest (a
    deterministic interposition: placed by load, turn 2 would go to the other server). The proxies record each
    request as it arrives; the tiny_cpu proxy answers a 503 itself for ids outside its 64-token vocabulary (a turn
    of the other model's trajectory), so a misplaced turn is seen and the session's server stays up. Break tried:
    ``prefer`` ignored by ``Dispatch.place`` -> trajectories split over both servers."""
    seen: dict[str, list[tuple[int, ...]]] = {"a": [], "b": []}
    lock = threading.Lock()

    def recorder(name, vocab=None):
        def request_hook(path, body):
            if path != "/generate":
                return body
            ids = tuple(json.loads(body)["input_ids"])
            with lock:
                seen[name].append(ids)
            return (503, b"outside this model's vocabulary") if vocab is not None and max(ids) >= vocab else body

        return request_hook

    busy = 10**6
    keep = lambda path, body, reply: None
    with (
        Proxy(sglang_server.url, keep, recorder("a")) as a,
        Proxy(tiny_cpu_server, keep, recorder("b", vocab=64)) as b,
    ):
        client = RolloutClient(
            [a.url, b.url], None, 512, SamplingSettings(max_new_tokens=3), return_sampling_mask=False, max_concurrency=4
        )

        async def own_server_busy(sample, generate) -> Trajectory:
            traj = Trajectory(group_id=sample.group_id)
            await generate(traj, sample.prompt_ids)
            client.dispatch.tokens[traj.server] += busy
            try:
                await generate(traj, traj.token_ids.tolist() + ENV)
            finally:
                client.dispatch.tokens[traj.server] -= busy
            return traj

        trajectories = []
        for g in range(4):
            sample = AgentSample(prompt_ids=[1 + g, 2, 3, 4 + g], group_id=g)
            trajectories += asyncio.run(run_agents(own_server_busy, [sample], client))[0]
    servers_of = _servers_of(seen)
    assert len(servers_of) == 8, f"expected 8 distinct turn prompts, got {len(servers_of)}"
    homes = []
    for traj in trajectories:
        assert traj.turns == 2
        first = tuple(traj.segments[0].token_ids.tolist())
        second = tuple(np.concatenate([s.token_ids for s in traj.segments[:3]]).tolist())
        assert len(servers_of[first] | servers_of[second]) == 1, (
            f"trajectory {traj.group_id}: turn 1 on {servers_of[first]}, turn 2 on {servers_of[second]}"
        )
        homes.append(next(iter(servers_of[first])))
    assert homes == ["a", "b", "a", "b"], f"first turns are placed by load, in rotation: {homes}"
    assert client.dispatch.tokens == [0, 0]
