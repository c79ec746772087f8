"""A second, bf16 SGLang server: route agreement with HF in bf16, then killed in the middle of a batch.

The kill comes last in this module, so this server's lifetime is the module.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import numpy as np
import pytest
import torch

from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.replies import RolloutError
from tests.rollout.hf_reference import load_hf_model, routes_agree, teacher_forced, topk_sets
from tests.rollout.test_sglang_fp32 import VOCAB, client_for, make_prompts

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def bf16_server(server_spec, tmp_path_factory):
    spec = dataclasses.replace(server_spec, dtype="bfloat16", port=None)
    server = SGLangServer(spec, tmp_path_factory.mktemp("sglang_bf16_logs") / "server.log")
    with server:
        yield server
    assert server.process is None


def test_routes_equal_hf_teacher_forced_topk_for_99_percent_in_bf16(bf16_server, route_spec, model_dir):
    """bf16 misses are near-ties: k-th and (k+1)-th router logits within bf16 rounding of each other.

    An exact tie in the reference's bf16 logits has two right answers; either counts as agreement.
    """
    client = RolloutClient([bf16_server.url], route_spec, VOCAB, SamplingSettings(1.0, 1.0, 50, 24), max_concurrency=8)
    samples = client.generate(make_prompts(16, seed=51), n=2)
    hf = load_hf_model(model_dir, torch.bfloat16)
    agree = total = 0
    miss_margins = []
    for s in samples:
        tokens = np.concatenate([s.prompt_ids, s.response_ids])[:-1]
        router_logits, _ = teacher_forced(hf, tokens, route_spec.moe_layer_ids)
        ok = routes_agree(router_logits, s.routes, route_spec.top_k)
        agree, total = agree + int(ok.sum()), total + ok.size
        miss_margins += topk_sets(router_logits, route_spec.top_k)[1][~ok].tolist()
    assert total >= 1000
    assert agree >= 0.99 * total, f"bf16 routes equal HF top-k for {agree}/{total}; miss margins {miss_margins}"
    assert max(miss_margins, default=0.0) < 0.01, f"a bf16 route miss is not a near-tie: margins {miss_margins}"


def test_seeded_request_is_bit_identical_alone_and_among_concurrent_requests(bf16_server, route_spec):
    """Deterministic inference on CPU holds in bf16 (oneDNN matmuls are batch-invariant; fp32 MKL ones are not)."""
    client = client_for([bf16_server.url], route_spec, max_concurrency=9)
    target = make_prompts(1, seed=11)
    alone = client.generate(target, n=1, group_ids=[7], step=3)[0]
    crowd = client.generate(target + make_prompts(8, seed=12), n=1, group_ids=[7, *range(100, 108)], step=3)[0]
    np.testing.assert_array_equal(crowd.response_ids, alone.response_ids)
    assert crowd.rollout_logp.tobytes() == alone.rollout_logp.tobytes(), "log-probs differ bitwise"
    np.testing.assert_array_equal(crowd.routes, alone.routes)
    other = client.generate(target, n=1, group_ids=[7], step=4)[0]
    assert not np.array_equal(other.response_ids, alone.response_ids), "a different seed gave the same sample"


def test_server_killed_mid_batch_gives_an_error_or_a_whole_retried_batch(bf16_server, sglang_server, route_spec):
    """One batch only knows the doomed server (must raise); one can fail over to the fp32 server (must be whole)."""
    sampling = SamplingSettings(1.0, 1.0, 50, 48)
    alone = RolloutClient([bf16_server.url], route_spec, VOCAB, sampling, max_retries=1, backoff_s=0.05)
    with_spare = RolloutClient(
        [bf16_server.url, sglang_server.url], route_spec, VOCAB, sampling, max_retries=3, backoff_s=0.05
    )
    prompts = make_prompts(8, seed=61)

    async def scenario():
        doomed = asyncio.ensure_future(alone.agenerate(prompts, n=2))
        rescued = asyncio.ensure_future(with_spare.agenerate(prompts, n=2, step=1))
        await asyncio.sleep(1.5)
        assert not doomed.done(), "the batch finished before the kill; the test needs longer generations"
        os.killpg(bf16_server.process.pid, signal.SIGKILL)
        return await asyncio.gather(doomed, rescued, return_exceptions=True)

    doomed, rescued = asyncio.run(scenario())
    assert isinstance(doomed, RolloutError), f"expected a RolloutError, got {doomed!r}"
    assert not isinstance(rescued, BaseException), f"the batch with a spare server failed: {rescued!r}"
    assert len(rescued) == 16 and all(len(s.rollout_logp) == len(s.response_ids) for s in rescued)
