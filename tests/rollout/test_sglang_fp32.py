"""Rollout client against the session's real SGLang CPU server (fp32, deterministic, routes on).

Oracles are independent of the code under test: HF `transformers` teacher-forced forwards of the
same checkpoint (tests/rollout/hf_reference.py) and the raw HTTP reply decoded by hand.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import torch

from moe_rl.records import RolloutSample, RouteSpec
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.ports import free_port
from moe_rl.rollout.replies import RolloutError, RolloutRequestError, RolloutResponseError
from moe_rl.sync.transport import server_weight_version, update_weights_from_disk
from tests.rollout.hf_reference import kept_set, load_hf_model, teacher_forced, topk_sets

pytestmark = pytest.mark.sglang

VOCAB = 512
SAMPLING = SamplingSettings(temperature=0.8, top_p=0.9, top_k=16, max_new_tokens=12)


def make_prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, VOCAB, size=int(rng.integers(5, 20))).tolist() for _ in range(count)]


def client_for(urls, spec, **kwargs) -> RolloutClient:
    kwargs.setdefault("sampling", SAMPLING)
    return RolloutClient(urls, spec, VOCAB, **kwargs)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(6, seed=0)


@pytest.fixture(scope="module")
def batch(sglang_server, route_spec, prompts):
    """6 prompts x 2 samples from the real server, through the client."""
    return client_for([sglang_server.url], route_spec, max_concurrency=8).generate(prompts, n=2)


@pytest.fixture(scope="module")
def hf_fp32(model_dir):
    return load_hf_model(model_dir, torch.float32)


def test_batch_is_whole_and_in_request_order(batch, prompts):
    assert len(batch) == 12, f"expected 6 prompts x 2 samples, got {len(batch)}"
    for k, s in enumerate(batch):
        assert s.group_id == k // 2
        np.testing.assert_array_equal(s.prompt_ids, prompts[k // 2])
        assert 1 <= len(s.response_ids) <= SAMPLING.max_new_tokens
        assert s.rollout_logp.shape == s.response_ids.shape and s.rollout_logp.dtype == np.float32
        assert s.weight_version and s.finish_reason in ("length", "stop")


def test_server_sends_no_route_row_for_last_token_and_zeros_for_dense_layer(sglang_server, prompts, rollout_model_cfg):
    """The raw wire format the decoder relies on: [P + R - 1, num_hidden_layers, K], dense = 0."""
    body = client_for([sglang_server.url], None).request_body(prompts[0], seed=5)
    body["return_routed_experts"] = True
    reply = httpx.post(f"{sglang_server.url}/generate", json=body, timeout=120).json()
    wire_dtype = reply["meta_info"].get("routed_experts_dtype", "int32")  # patched server: uint8
    raw = np.frombuffer(base64.b64decode(reply["meta_info"]["routed_experts"]), dtype=wire_dtype)
    rows = len(prompts[0]) + len(reply["output_ids"]) - 1
    layers = rollout_model_cfg.num_layers
    assert raw.size == rows * layers * 2, (
        f"{raw.size} {wire_dtype} values; expected {rows} rows x {layers} layers x top-2"
    )
    raw = raw.reshape(rows, layers, 2)
    assert (raw[:, 0] == 0).all(), "the dense layer 0 should carry all-zero routes"
    assert (raw[:, 1:, 0] != raw[:, 1:, 1]).all(), "MoE layers must route to two distinct experts"


def test_routes_keep_only_moe_layers_with_one_row_per_forwarded_token(batch, route_spec):
    for s in batch:
        expected = (len(s.prompt_ids) + len(s.response_ids) - 1, len(route_spec.moe_layer_ids), route_spec.top_k)
        assert s.routes.shape == expected, f"routes {s.routes.shape}, expected {expected}"
        assert s.routes.dtype == np.uint8 and s.routes.max() < route_spec.num_experts


def test_routes_equal_hf_teacher_forced_topk_in_fp32(batch, hf_fp32, route_spec):
    agree = total = 0
    for s in batch:
        tokens = np.concatenate([s.prompt_ids, s.response_ids])[:-1]
        router_logits, _ = teacher_forced(hf_fp32, tokens, route_spec.moe_layer_ids)
        ref, _ = topk_sets(router_logits, route_spec.top_k)
        same = (np.sort(s.routes.astype(np.int64), axis=-1) == ref).all(axis=-1)
        agree, total = agree + int(same.sum()), total + same.size
    assert total >= 200
    assert agree == total, f"fp32 routes equal HF top-k for {agree}/{total} (token, layer) pairs; expected all"


def test_sampled_tokens_lie_in_kept_sets_that_match_top_k_top_p(batch, hf_fp32, route_spec):
    checked = ambiguous = 0
    for s in batch:
        tokens = np.concatenate([s.prompt_ids, s.response_ids])
        _, logits = teacher_forced(hf_fp32, tokens[:-1], route_spec.moe_layer_ids)
        p = len(s.prompt_ids)
        for t, (tok, kept) in enumerate(zip(s.response_ids, s.sampling_mask)):
            assert int(tok) in set(kept.tolist()), f"sample token {tok} at step {t} is outside its kept set"
            assert 1 <= len(kept) <= SAMPLING.top_k, f"kept set of {len(kept)} ids exceeds top_k={SAMPLING.top_k}"
            ref, margin = kept_set(logits[p - 1 + t], SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p)
            if margin < 1e-5:  # the top-p cutoff sits on a float tie: either answer is right
                ambiguous += 1
                continue
            checked += 1
            assert set(kept.tolist()) == ref, f"step {t}: kept {sorted(kept.tolist())} != reference {sorted(ref)}"
    assert checked >= 0.9 * (checked + ambiguous)


def test_behaviour_logprobs_equal_hf_full_vocab_logprobs(batch, hf_fp32, route_spec):
    for s in batch:
        tokens = np.concatenate([s.prompt_ids, s.response_ids])
        _, logits = teacher_forced(hf_fp32, tokens[:-1], route_spec.moe_layer_ids)
        rows = torch.log_softmax(torch.from_numpy(logits[len(s.prompt_ids) - 1 :]) / SAMPLING.temperature, dim=-1)
        ref = rows[torch.arange(len(s.response_ids)), torch.from_numpy(s.response_ids).long()].numpy()
        np.testing.assert_allclose(s.rollout_logp, ref, atol=2e-4, err_msg="log-probs over the full tempered vocab")


def test_weight_update_changes_outputs_and_restoring_restores_them(sglang_server, route_spec, model_dir, model_dir_v2):
    # One request at a time: fp32 CPU matmuls are not batch-invariant, so identical batching is
    # what makes "restored" comparable bit for bit (bf16 batch invariance: the bf16 module).
    client = client_for([sglang_server.url], route_spec, max_concurrency=1)
    prompts = make_prompts(3, seed=21)
    before = client.generate(prompts, n=1)
    update_weights_from_disk([sglang_server.url], model_dir_v2, "v2")
    try:
        assert server_weight_version(sglang_server.url) == "v2"
        after = client.generate(prompts, n=1)
    finally:
        update_weights_from_disk([sglang_server.url], model_dir, "v1-restored")
    restored = client.generate(prompts, n=1)
    assert all(s.weight_version == "v2" for s in after)
    assert all(s.weight_version == "v1-restored" for s in restored)
    assert any(a.rollout_logp.tobytes() != b.rollout_logp.tobytes() for a, b in zip(before, after))
    for b, r in zip(before, restored):
        np.testing.assert_array_equal(r.response_ids, b.response_ids)
        assert r.rollout_logp.tobytes() == b.rollout_logp.tobytes()
        np.testing.assert_array_equal(r.routes, b.routes)


def test_routes_of_a_size_the_model_disagrees_with_raise_a_clear_error(sglang_server):
    wrong = RouteSpec(num_hidden_layers=3, moe_layer_ids=(1, 2), top_k=4, num_experts=8)  # server sends top-2
    with pytest.raises(RolloutResponseError, match="routed_experts"):
        client_for([sglang_server.url], wrong).generate(make_prompts(2, seed=31), n=2)


def test_http_4xx_is_reported_without_retry(sglang_server, route_spec):
    too_long = [list(range(4, 304))]  # 300 tokens > the model's 256 positions
    client = client_for([sglang_server.url], route_spec, max_retries=3, backoff_s=5.0)
    with pytest.raises(RolloutRequestError, match="HTTP 4"):
        asyncio.run(asyncio.wait_for(client.agenerate(too_long, n=1), timeout=60))  # a retry would wait 5 s+


def test_unreachable_server_is_retried_elsewhere_and_batch_is_whole(sglang_server, route_spec):
    dead = f"http://127.0.0.1:{free_port()}"
    client = client_for([dead, sglang_server.url], route_spec, max_retries=2, backoff_s=0.01)
    samples = client.generate(make_prompts(3, seed=41), n=2)
    assert len(samples) == 6 and all(s.routes is not None for s in samples)
    with pytest.raises(RolloutError, match="after 2 attempts"):
        client_for([dead], route_spec, max_retries=1, backoff_s=0.01).generate(make_prompts(1, seed=42), n=1)


def test_server_never_called_a_cpu_stand_in(sglang_server, batch):
    """The sgl_kernel / torchvision stand-ins print a marker to the server log when anything calls them."""
    log = sglang_server.log_path.read_text(errors="replace")
    assert "moe_rl stand-in" not in log, "the server called into a CPU stand-in: " + next(
        line for line in log.splitlines() if "moe_rl stand-in" in line
    )


def test_generate_never_formats_the_samples(sglang_server, route_spec, prompts, monkeypatch):
    """`asyncio.run` reprs its main task on exit (restoring SIGINT): the samples must not be its result.

    That repr of every sample's arrays was 7% of the client's time in bench/profile_rollout.py.
    """

    formatted = []  # reprlib (which asyncio uses) swallows exceptions raised by __repr__: count calls instead
    monkeypatch.setattr(RolloutSample, "__repr__", lambda self: formatted.append(1) or "RolloutSample(...)")
    samples = client_for([sglang_server.url], route_spec).generate(prompts[:2], n=2)
    assert formatted == [], f"generate formatted {len(formatted)} samples with repr()"
    assert len(samples) == 4 and all(s.routes is not None for s in samples)
