"""A ``/generate`` request past its bound (``rollout.request_timeout_s``) is continued from what it generated, not
sent again from its start (issue 53 item 2), against the session's real SGLang server.

Interposition (``tests/http_proxy.Proxy``), no race: the first request is forwarded with ``max_new_tokens=K``, and
its reply is held in the proxy until the client's ``/abort_request`` for that request's ``rid`` arrives (answered by
the proxy: the upstream request is over) -- so the bound must pass first -- then handed back as SGLang hands back a
running request it aborted (``finish_reason`` abort, "Aborted", the K tokens with their log-probs, route rows and
kept sets). The client must continue it: a request whose prompt is the prompt + those K tokens, for the rest of the
budget, stitched into one sample. On a loaded machine a continuation may pass the bound too and be aborted for
real: every request is then checked to continue the one before it, never to start over.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from moe_rl.rollout.client import RolloutClient, SamplingSettings
from tests.http_proxy import Proxy

pytestmark = pytest.mark.sglang

VOCAB, TOP_K, K, BUDGET, BOUND_S = 512, 16, 3, 9, 5.0
PROMPT = [5, 17, 99, 250, 7, 31]


def test_a_request_past_its_bound_is_continued_from_its_tokens(sglang_server, route_spec):
    bodies, replies, aborts, aborted = [], {}, [], threading.Event()

    def request_hook(path, body):
        if path == "/abort_request" and bodies and json.loads(body)["rid"] == bodies[0]["rid"]:
            aborts.append(json.loads(body))
            aborted.set()
            return 200, b""  # the held request is over upstream: nothing to abort there
        if path == "/abort_request":
            aborts.append(json.loads(body))  # a continuation past the bound on a loaded machine: a real abort
        if path != "/generate":
            return body
        req = json.loads(body)
        req["sampling_params"]["ignore_eos"] = True  # every request runs its whole budget
        if not bodies:
            req["sampling_params"]["max_new_tokens"] = K  # upstream stops where the abort will be said to come
        bodies.append(req)
        return json.dumps(req).encode()

    def hook(path, body, reply):
        if path != "/generate":
            return None
        out, rid = reply.json(), json.loads(body)["rid"]
        replies[rid] = out
        if rid != bodies[0]["rid"]:
            return None
        assert aborted.wait(120), "the client never aborted the request past its bound"
        out["meta_info"]["finish_reason"] = {"type": "abort", "message": "Aborted"}  # SGLang's FINISH_ABORT()
        return 200, json.dumps(out).encode()

    with Proxy(sglang_server.url, hook, request_hook) as proxy:
        try:
            client = RolloutClient(
                [proxy.url], route_spec, VOCAB, SamplingSettings(1.0, 1.0, TOP_K, BUDGET), request_timeout_s=BOUND_S
            )
            (sample,) = client.generate([PROMPT], n=1)
        finally:
            aborted.set()  # never leave a proxy thread waiting
    sent = [b["input_ids"] for b in bodies]
    assert aborts[:1] == [{"rid": bodies[0]["rid"]}], f"the request past its bound was not aborted; sent: {sent}"
    assert len(bodies) >= 2, sent
    outputs = [replies[b["rid"]]["output_ids"] for b in bodies]
    assert len(outputs[0]) == K
    assert bodies[1]["input_ids"] == PROMPT + outputs[0], "continued from the prompt + its tokens, not restarted"
    for before, after, out in zip(bodies, bodies[1:], outputs):
        assert after["input_ids"] == before["input_ids"] + out, "every request continues the one before it"
        done = len(after["input_ids"]) - len(PROMPT)
        assert after["sampling_params"]["max_new_tokens"] == BUDGET - done
        assert after["routed_experts_start_len"] == len(PROMPT) + done - 1
    assert sample.response_ids.tolist() == [t for out in outputs for t in out] and len(sample.response_ids) == BUDGET
    assert sample.rollout_logp.shape == (BUDGET,) and np.isfinite(sample.rollout_logp).all()
    assert sample.routes.shape[0] == len(PROMPT) + BUDGET - 1
    assert len(sample.sampling_mask) == BUDGET and sample.finish_reason == "length"
    assert client.partial_counters.continued_requests == len(bodies) - 1
