"""Partial rollouts against the session's real SGLang CPU server: a weight push (tensor path) in the middle
of a long generation, inside ``paused_generation`` in each pause mode.

Oracle: teacher-forced passes of the same server under each version's weights (``/generate`` over
prompt + response with ``max_new_tokens=1``, input log-probs, top-16 ids and routed experts): every
token's recorded log-prob, route row (the forward pass that produced it) and kept set must equal those of
the version ``token_versions`` names. The session checkpoint (v1) is restored before each test returns.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import numpy as np
import pytest

from moe_rl.learner.hf_convert import read_hf_state_dict
from moe_rl.records.sglang_meta import decode_routes
from moe_rl.rollout.auth import RUN_ADMIN_KEY_ENV, ServerKeys
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.partial import PartialRolloutError, paused_generation
from moe_rl.sync.checks import reference_from_hf_dir
from moe_rl.sync.transport import update_weights_from_disk
from moe_rl.sync.weight_sync import WeightSync

pytestmark = pytest.mark.sglang

VOCAB = 512
TOP_K = 16  # top_p=1: the kept set is exactly the top-16 ids, which a teacher-forced pass also returns
BUDGET = 240  # the tiny model's context is 256 tokens
PROMPT = [5, 17, 99, 250, 7, 31]
LOGP_ATOL = 2e-4  # fp32: a decode step vs a teacher-forced prefill differ by kernel rounding only
TIE_ROOM = 8  # the oracle also returns the ids ranked just below the kept set, for ties at its boundary


class _NoEosClient(RolloutClient):
    """The real client; its requests ignore EOS so every attempt is long enough to be interrupted."""

    def request_body(self, *args, **kwargs):
        body = super().request_body(*args, **kwargs)
        body["sampling_params"]["ignore_eos"] = True
        return body


def _wait_until_generating(
    url: str, done: threading.Event, min_tokens: int, timeout_s: float = 180.0, poll_s: float = 0.01
) -> None:
    """Until the server holds `min_tokens` of KV (the request is well into its decode) or it finished."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done.is_set():
        loads = httpx.get(f"{url}/v1/loads", timeout=30).json()["loads"]
        if sum(load["num_total_tokens"] for load in loads) >= min_tokens:
            return
        time.sleep(poll_s)


def _spanning_sample(url, route_spec, model_dir, model_dir_v2, rollout_model_cfg, mode):
    """(sample, client) of a generation interrupted by a pushed update step-0 -> step-1 in `mode`."""
    sync = WeightSync("tensor", rollout_model_cfg, bucket_bytes=64 << 10, reference=reference_from_hf_dir(model_dir))
    v2 = read_hf_state_dict(model_dir_v2)
    for attempt in range(3):  # a generation that finished before the pause is retried with another seed
        update_weights_from_disk([url], model_dir, "step-0")
        client = _NoEosClient([url], route_spec, VOCAB, SamplingSettings(1.0, 1.0, TOP_K, BUDGET), pause_mode=mode)
        out, done = [], threading.Event()

        def generate(out=out, client=client, attempt=attempt, done=done):
            try:
                out.extend(client.generate([PROMPT], n=1, step=attempt))
            finally:
                done.set()

        worker = threading.Thread(target=generate)
        worker.start()
        _wait_until_generating(url, done, len(PROMPT) + 40)
        with paused_generation([url], mode) as window:
            sync.push(v2, [url], "step-1", flush_cache=window.flush_cache)
        worker.join(timeout=300)
        assert out, "the generation thread returned nothing"
        if np.unique(out[0].token_versions).size > 1:
            return out[0], client
    pytest.fail("3 generations of 240 tokens all finished before the pause")


def _teacher_forced(url, route_spec, prompt, response) -> dict:
    """Log-prob, top-16 ids of each response token and route rows [P + R - 1] under the served weights."""
    tokens = [int(t) for t in (*prompt, *response)]
    body = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": len(prompt) - 1,
        "top_logprobs_num": TOP_K + TIE_ROOM,
        "return_routed_experts": True,
    }
    meta = httpx.post(f"{url}/generate", json=body, timeout=120).json()["meta_info"]
    rows = meta["input_token_logprobs"][1:]  # entry 0 is the prompt's last token
    # SGLang reports the last vocab id as 0 in input_token_logprobs (an image-hash clip); the value is right
    assert [r[1] for r in rows] == [int(t) if t < VOCAB - 1 else 0 for t in response]
    routes = decode_routes(meta, len(tokens), 1, route_spec)  # P + R rows
    return {
        "logp": np.array([r[0] for r in rows], np.float64),
        "top": [
            sorted(((int(x[1]), float(x[0])) for x in top), key=lambda e: -e[1])
            for top in meta["input_top_logprobs"][1:]
        ],
        "routes": np.sort(routes[: len(tokens) - 1], axis=-1),
    }


def _is_top_k(kept: list[int], top: list[tuple[int, float]]) -> bool:
    """`kept` is the top-`TOP_K` of the oracle's ranked (id, log-prob) list, where an id whose log-prob is within
    rounding (LOGP_ATOL) of the `TOP_K`-th one may be in or out: a decode step and a prefill may order such a tie
    either way (the random-init model's distribution is nearly flat, so near-ties at the boundary do occur)."""
    boundary = top[TOP_K - 1][1]
    sure = {i for i, logp in top if logp > boundary + LOGP_ATOL}
    possible = {i for i, logp in top if logp >= boundary - LOGP_ATOL}
    return len(kept) == TOP_K and sure <= set(kept) <= possible and len(possible) < len(top)


def _check_provenance(url, route_spec, sample, oracles) -> None:
    """Every token's log-prob, route row and kept set are those of the version `token_versions` names."""
    p, versions = len(sample.prompt_ids), sample.token_versions
    routes = np.sort(sample.routes, axis=-1)
    for t, v in enumerate(versions):
        tf = oracles[int(v)]
        assert abs(float(sample.rollout_logp[t]) - tf["logp"][t]) <= LOGP_ATOL, (t, v)
        kept = sorted(sample.sampling_mask[t].tolist())
        assert _is_top_k(kept, tf["top"][t]), (t, v, kept, tf["top"][t])
        np.testing.assert_array_equal(routes[p + t - 1], tf["routes"][p + t - 1], err_msg=f"token {t} (version {v})")
    np.testing.assert_array_equal(routes[: p - 1], oracles[int(versions[0])]["routes"][: p - 1], err_msg="prompt rows")


@pytest.fixture
def oracles_for(sglang_server, route_spec, model_dir, model_dir_v2):
    """`oracles_for(sample)`: teacher-forced passes of the sample under step-0 and step-1; restores v1."""
    url = sglang_server.url

    def oracles(sample):
        out = {}
        for version, path in ((0, model_dir), (1, model_dir_v2)):
            update_weights_from_disk([url], path, f"step-{version}")
            out[version] = _teacher_forced(url, route_spec, sample.prompt_ids, sample.response_ids)
        return out

    yield oracles
    update_weights_from_disk([url], model_dir, "v1")


@pytest.mark.parametrize("mode", ["retract", "abort"])
def test_a_response_spanning_an_update_keeps_each_tokens_own_version(
    mode, sglang_server, route_spec, model_dir, model_dir_v2, rollout_model_cfg, oracles_for
):
    url = sglang_server.url
    sample, client = _spanning_sample(url, route_spec, model_dir, model_dir_v2, rollout_model_cfg, mode)
    versions = sample.token_versions
    split = int(np.argmax(versions == 1))
    assert len(sample.response_ids) == BUDGET and sample.weight_version == "step-1"
    assert versions.dtype == np.int32 and split > 0 and (versions[:split] == 0).all() and (versions[split:] == 1).all()
    assert sample.routes.shape[0] == len(sample.prompt_ids) + BUDGET - 1
    oracles = oracles_for(sample)
    p = len(sample.prompt_ids)
    old_rows = np.sort(sample.routes[p - 1 : p + split - 1], axis=-1)
    # the check has teeth: the new weights route the old tokens differently (what a re-prefill would record)
    assert (oracles[0]["routes"][p - 1 : p + split - 1] != oracles[1]["routes"][p - 1 : p + split - 1]).any()
    assert (old_rows != oracles[1]["routes"][p - 1 : p + split - 1]).any(), "re-prefill overwrote earlier rows"
    _check_provenance(url, route_spec, sample, oracles)
    counters = client.partial_counters.drain()
    assert counters["async/partial_samples"] == 1 and counters["async/kv_stale_tokens"] == 0
    assert counters["async/continued_requests"] == (1 if mode == "abort" else 0)


def test_in_place_counts_the_tokens_sampled_on_old_prefix_kv_as_stale(
    sglang_server, route_spec, model_dir, model_dir_v2, rollout_model_cfg, oracles_for
):
    url = sglang_server.url
    sample, client = _spanning_sample(url, route_spec, model_dir, model_dir_v2, rollout_model_cfg, "in_place")
    oracles_for(sample)  # restores v1 afterwards
    stale = int((sample.token_versions == 1).sum())
    assert 0 < stale < BUDGET
    counters = client.partial_counters.drain()
    assert counters == {"async/kv_stale_tokens": stale, "async/partial_samples": 1, "async/continued_requests": 0}
    assert client.partial_counters.drain()["async/kv_stale_tokens"] == 0, "drain resets"


class _RecordingClient(_NoEosClient):
    """The real client; it also keeps every reply's finish reason (the test's evidence of a queued abort)."""

    finishes: list

    async def _post(self, http, url, body):
        reply, bound_hit = await super()._post(http, url, body)
        self.finishes.append(reply["meta_info"].get("finish_reason"))
        return reply, bound_hit


def test_abort_pause_continues_requests_aborted_while_still_queued(sglang_server, route_spec):
    """A request still in SGLang's waiting queue when ``pause_generation(abort)`` comes is ended with "Abort in
    waiting queue" and no tokens; the client must send it again like any paused request (the old client raised
    'aborted the generation: Abort in waiting queue'). A retract pause first moves the running requests into the
    waiting queue -- where requests beyond the server's running slots wait -- so the abort finds them queued."""
    url, budget = sglang_server.url, 64
    client = _RecordingClient([url], route_spec, VOCAB, SamplingSettings(1.0, 1.0, TOP_K, budget), pause_mode="abort")
    client.finishes = []
    out, errors, done = [], [], threading.Event()

    def generate():
        try:
            out.extend(client.generate([PROMPT], n=3, step=0))
        except Exception as err:  # noqa: BLE001 -- reported by the assertion below
            errors.append(err)
        finally:
            done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    _wait_until_generating(url, done, 3 * (len(PROMPT) + 8), poll_s=0.05)  # all three are decoding
    assert not done.is_set(), "the generation finished before the pause"
    with paused_generation([url], "retract"), paused_generation([url], "abort"):
        pass
    worker.join(timeout=600)
    assert not worker.is_alive() and not errors, errors
    queued = [f for f in client.finishes if isinstance(f, dict) and f.get("message") == "Abort in waiting queue"]
    assert queued, f"no request was aborted while queued: {client.finishes}"
    assert [len(s.response_ids) for s in out] == [budget] * 3, [len(s.response_ids) for s in out]
    assert client.partial_counters.continued_requests >= len(queued), client.partial_counters
    assert all(s.finish_reason == "length" and np.isfinite(s.rollout_logp).all() for s in out), out


@pytest.fixture(scope="module")
def keyed_server(server_spec, tmp_path_factory):
    """A second server of the session checkpoint that has an admin key (generate stays open)."""

    keys = ServerKeys.fresh()
    spec = dataclasses.replace(server_spec, admin_api_key_env=RUN_ADMIN_KEY_ENV, deterministic=False)
    log = tmp_path_factory.mktemp("keyed_sglang") / "server.log"
    with SGLangServer(spec, log, secret_env=keys.server_env()) as server:
        yield server, keys


def test_pause_and_continue_carry_the_admin_key_and_always_continue(keyed_server):
    server, keys = keyed_server
    url = server.url
    with (
        pytest.raises(PartialRolloutError, match=f"{url}/pause_generation refused, HTTP 401"),
        paused_generation([url], "retract"),
    ):  # no key
        pass
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
    replies = []
    with paused_generation([url], "retract", keys):
        waiting = threading.Thread(target=lambda: replies.append(httpx.post(f"{url}/generate", json=body, timeout=120)))
        waiting.start()
        time.sleep(1.0)
        assert not replies, "a request sent while paused must wait for /continue_generation"
    waiting.join(timeout=120)
    assert replies and replies[0].status_code == 200
    with pytest.raises(RuntimeError, match="push failed"), paused_generation([url], "abort", keys):
        raise RuntimeError("push failed")
    assert httpx.post(f"{url}/generate", json=body, timeout=60).status_code == 200, "left paused after a failure"
