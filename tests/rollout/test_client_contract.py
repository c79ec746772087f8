"""Client request construction and input validation (no server needed)."""

from __future__ import annotations

import asyncio
import itertools
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_rl.config import ExperimentConfig
from moe_rl.records import RouteSpec
from moe_rl.rollout.client import RolloutClient, SamplingSettings, sample_seed
from moe_rl.rollout.dispatch import Group

SPEC = RouteSpec(num_hidden_layers=2, moe_layer_ids=(0, 1), top_k=2, num_experts=8)


def test_sample_seeds_do_not_collide_across_steps_groups_and_samples():
    keys = list(itertools.product(range(3), range(20), range(40), range(8)))
    seeds = {sample_seed(*k) for k in keys}
    assert len(seeds) == len(keys)


@given(st.integers(0, 2**40), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 1024))
def test_sample_seed_is_a_stable_uint32(base, step, group, index):
    s = sample_seed(base, step, group, index)
    assert 0 <= s < 2**32 and s == sample_seed(base, step, group, index)


def test_sample_seed_rejects_negative_parts():
    with pytest.raises(ValueError, match=">= 0"):
        sample_seed(0, -1, 0, 0)


def test_request_asks_for_logprobs_routes_masks_and_the_seed():
    body = RolloutClient(["http://h:1"], SPEC, 512, SamplingSettings(0.7, 0.9, 20, 8)).request_body([5, 6], seed=9)
    assert body["input_ids"] == [5, 6]
    assert body["return_logprob"] and body["return_routed_experts"] and body["return_sampling_mask"]
    assert body["sampling_params"] == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_new_tokens": 8,
        "sampling_seed": 9,
    }


def test_no_top_k_with_masks_is_sent_as_the_whole_vocabulary():
    client = RolloutClient(["http://h:1"], SPEC, 512, SamplingSettings(top_k=-1))
    assert client.request_body([5], seed=None)["sampling_params"]["top_k"] == 512
    no_masks = RolloutClient(["http://h:1"], SPEC, 512, SamplingSettings(top_k=-1), return_sampling_mask=False)
    assert no_masks.request_body([5], seed=None)["sampling_params"]["top_k"] == -1


def test_a_vocabulary_above_the_mask_cap_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match="sampling_mask_max_tokens >= vocab size"):
        RolloutClient(["http://h:1"], SPEC, 512, SamplingSettings(top_k=-1), sampling_mask_max_tokens=100)
    with pytest.raises(ValueError, match="rollout.top_k=200 exceeds"):
        RolloutClient(["http://h:1"], SPEC, 512, SamplingSettings(top_k=200), sampling_mask_max_tokens=100)


@pytest.mark.parametrize(
    ("prompts", "kwargs", "message"),
    [
        ([[1]], {"n": 0}, "n=0"),
        ([[1], []], {}, r"prompts\[1\] is empty"),
        ([[1], [2]], {"group_ids": [0]}, "group_ids has 1 entries"),
    ],
)
def test_bad_batch_arguments_fail_before_any_request(prompts, kwargs, message):
    client = RolloutClient(["http://127.0.0.1:9"], SPEC, 512)
    with pytest.raises(ValueError, match=message):
        client.generate(prompts, **kwargs)


def test_from_config_always_requests_routes_and_masks_only_for_keep_sampling_mask():
    plain = RolloutClient.from_config(ExperimentConfig(), ["http://h:1"])
    # routes even without replay: the flip-rate metric of a routing=none baseline needs them
    assert plain.route_spec == RouteSpec.from_model_config(ExperimentConfig().model)
    assert not plain.return_sampling_mask
    cfg = ExperimentConfig.model_validate(
        {"replay": {"routing": "r3", "keep_sampling_mask": True}, "rollout": {"top_k": 50}}
    )
    r3 = RolloutClient.from_config(cfg, ["http://h:1"])
    assert r3.route_spec == RouteSpec.from_model_config(cfg.model) and r3.return_sampling_mask


def _balanced_client(balance: str) -> RolloutClient:
    return RolloutClient(
        ["http://a", "http://b"], None, 64, max_concurrency=8, return_sampling_mask=False, load_balance=balance
    )


def test_least_outstanding_orders_retries_by_requests_in_flight_and_round_robins_ties():
    client = _balanced_client("least_outstanding")
    assert [client.dispatch.order()[0] for _ in range(4)] == [0, 1, 0, 1], "ties: round robin"
    client.dispatch.in_flight = [3, 1]
    assert [client.dispatch.order() for _ in range(2)] == [[1, 0], [1, 0]], "the less loaded server first"
    rr = _balanced_client("round_robin")
    rr.dispatch.in_flight = [3, 1]
    assert [rr.dispatch.order()[0] for _ in range(2)] == [0, 1], "round robin ignores the load"
    with pytest.raises(ValueError, match="load_balance='busiest'"):
        _balanced_client("busiest")


@pytest.mark.parametrize(("balance", "fast_share"), [("least_outstanding", (0.7, 1.0)), ("round_robin", (0.5, 0.5))])
def test_a_slow_server_gets_fewer_requests_under_least_outstanding(monkeypatch, balance, fast_share):
    """A stand-in for two servers (``_post`` and ``_to_sample`` replaced: the point is where requests go, not SGLang):
    server a answers after 8 turns of the event loop, b after 1; 8 in flight, 48 requests. Time is counted in loop
    turns, not seconds, so the placement is the same however loaded the machine is (no timer can fire early or late).
    """

    client, sent = _balanced_client(balance), []

    async def post(http, url, body):
        sent.append(url)
        for _ in range(8 if url == "http://a" else 1):
            await asyncio.sleep(0)
        return {}, False  # (reply, ran past its bound)

    monkeypatch.setattr(client, "_post", post)
    done = types.SimpleNamespace(response_ids=[], token_versions=None)
    monkeypatch.setattr(client, "_to_sample", lambda reply, prompt, group_id, url, start=0, own=False: done)

    async def run():  # 48 groups of one sample: each placed when its sample takes one of 8 slots
        gate = asyncio.Semaphore(8)
        await asyncio.gather(*(client._one(None, gate, [1, 2], 0, None, 0, 4, Group(6, 1)) for _ in range(48)))

    asyncio.run(run())
    share = sent.count("http://b") / len(sent)
    assert fast_share[0] <= share <= fast_share[1], (balance, share)
    assert client.dispatch.in_flight == [0, 0] and client.dispatch.tokens == [0, 0]
