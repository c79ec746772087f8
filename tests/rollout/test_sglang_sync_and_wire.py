"""Against the session's real SGLang CPU server: compact wire, incremental routes, weight sync without disk.

Oracles: the raw HTTP reply decoded by hand, a from-scratch request of the same tokens, and the
disk sync path (SGLang's own checkpoint loader) for the tensor sync path. Every test that changes
the served weights restores the session checkpoint through the disk path before it returns.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from moe_rl.learner.hf_convert import read_hf_state_dict
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.sync import transport
from moe_rl.sync.checks import ServerInvalidError, reference_from_hf_dir
from moe_rl.sync.quantize import quantize_hf_dir
from moe_rl.sync.transport import WeightSyncError, server_weight_version, update_weights_from_disk
from moe_rl.sync.weight_sync import WeightSync

pytestmark = pytest.mark.sglang

VOCAB = 512
SAMPLING = SamplingSettings(temperature=0.8, top_p=0.9, top_k=16, max_new_tokens=8)
PROMPTS = [[5, 17, 99, 250, 7, 31], [400, 12, 3, 88, 91, 64, 23, 9]]


def _generate(url, spec, prompts=PROMPTS, **kwargs):
    client = RolloutClient([url], spec, VOCAB, SAMPLING, max_concurrency=1)  # one at a time: fp32 bit-exact
    return client.generate(prompts, n=1, step=3, **kwargs)


def _assert_same_outputs(got, want):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.response_ids, w.response_ids)
        assert g.rollout_logp.tobytes() == w.rollout_logp.tobytes(), "log-probs differ"
        np.testing.assert_array_equal(g.routes, w.routes)


def _restore(url, model_dir):
    update_weights_from_disk([url], model_dir, "v1")


@pytest.fixture(scope="module")
def disk_outputs(sglang_server, route_spec, model_dir, model_dir_v2):
    """Outputs with the session checkpoint (v1) and after a disk sync to v2 (the reference path)."""
    url = sglang_server.url
    _restore(url, model_dir)
    v1 = _generate(url, route_spec)
    update_weights_from_disk([url], model_dir_v2, "disk-v2")
    try:
        v2 = _generate(url, route_spec)
    finally:
        _restore(url, model_dir)
    assert any(a.rollout_logp.tobytes() != b.rollout_logp.tobytes() for a, b in zip(v1, v2)), "v1 == v2?"
    return {"v1": v1, "v2": v2}


@pytest.fixture
def tensor_sync(rollout_model_cfg, model_dir):
    """Tensor sync checked against the served checkpoint; 64 KiB buckets so a sync takes several requests."""
    return WeightSync("tensor", rollout_model_cfg, bucket_bytes=64 << 10, reference=reference_from_hf_dir(model_dir))


def test_patched_server_sends_compact_routes_and_kept_sets(sglang_server, route_spec, rollout_model_cfg):
    body = RolloutClient([sglang_server.url], route_spec, VOCAB, SAMPLING).request_body(PROMPTS[0], seed=5)
    meta = httpx.post(f"{sglang_server.url}/generate", json=body, timeout=120).json()["meta_info"]
    assert meta["routed_experts_dtype"] == "uint8", "8 experts fit one byte per id"
    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.uint8)
    response_len = meta["completion_tokens"]
    rows = len(PROMPTS[0]) + response_len - 1
    layers = rollout_model_cfg.num_layers
    assert raw.size == rows * layers * 2, (
        f"{raw.size} bytes; expected {rows} rows x {layers} layers x top-2, 1 byte each"
    )
    assert (raw.reshape(rows, layers, 2)[:, 0] == 0).all(), "the dense layer 0 should carry all-zero routes"
    assert "output_token_sampling_mask" not in meta, "kept sets should travel compactly, not as JSON lists"
    assert meta["output_token_sampling_mask_dtype"] == "uint16"
    lengths = meta["output_token_sampling_mask_lengths"]
    ids = np.frombuffer(base64.b64decode(meta["output_token_sampling_mask_ids"]), dtype="<u2")
    assert len(lengths) == response_len and ids.size == sum(lengths) and all(1 <= n <= 16 for n in lengths)
    assert len(meta["output_token_sampling_logprobs"]) == response_len


def test_incremental_routes_of_a_continued_generation_equal_a_from_scratch_request(sglang_server, route_spec):
    url = sglang_server.url
    first = _generate(url, route_spec, prompts=PROMPTS[:1])[0]
    turn2 = [np.concatenate([first.prompt_ids, first.response_ids]).tolist()]
    start = len(turn2[0]) - 1  # rows before it came with turn 1; the last response token was never forwarded
    incremental = _generate(url, route_spec, prompts=turn2, routes_start_len=[start])[0]
    scratch = _generate(url, route_spec, prompts=turn2)[0]
    np.testing.assert_array_equal(incremental.response_ids, scratch.response_ids)
    assert incremental.routes.shape[0] == len(incremental.response_ids), "one row per new forwarded token"
    np.testing.assert_array_equal(incremental.routes, scratch.routes[start:])
    np.testing.assert_array_equal(np.concatenate([first.routes, incremental.routes]), scratch.routes)


def test_tensor_sync_serves_what_disk_sync_serves(
    sglang_server, route_spec, model_dir, model_dir_v2, disk_outputs, tensor_sync
):
    url = sglang_server.url
    try:
        tensor_sync.push(read_hf_state_dict(model_dir_v2), [url], "tensor-v2")
        assert server_weight_version(url) == "tensor-v2"
        after = _generate(url, route_spec)
    finally:
        _restore(url, model_dir)
    assert all(s.weight_version == "tensor-v2" for s in after)
    _assert_same_outputs(after, disk_outputs["v2"])


def test_fp8_rollout_weights_hold_on_the_tensor_path(
    sglang_server, route_spec, model_dir, model_dir_v2, rollout_model_cfg, disk_outputs, tmp_path
):
    url = sglang_server.url
    quantized_dir = shutil.copytree(model_dir_v2, tmp_path / "v2_fp8")
    assert quantize_hf_dir(quantized_dir, "fp8_e4m3") > 0
    sync = WeightSync("tensor", rollout_model_cfg, weight_quantization="fp8_e4m3", bucket_bytes=1 << 20)
    try:
        update_weights_from_disk([url], quantized_dir, "disk-fp8")
        want = _generate(url, route_spec)
        sync.push(read_hf_state_dict(model_dir_v2), [url], "tensor-fp8")
        got = _generate(url, route_spec)
    finally:
        _restore(url, model_dir)
    _assert_same_outputs(got, want)
    assert any(a.rollout_logp.tobytes() != b.rollout_logp.tobytes() for a, b in zip(got, disk_outputs["v2"])), (
        "FP8 weights should change the log-probs"
    )


@pytest.mark.parametrize("damage", ["nan", "shape", "unknown-name"])
def test_bad_weights_are_refused_and_the_previous_weights_keep_serving(
    damage, sglang_server, route_spec, model_dir, model_dir_v2, disk_outputs, tensor_sync
):
    url = sglang_server.url
    state = read_hf_state_dict(model_dir_v2)
    name = "model.layers.1.self_attn.o_proj.weight"
    if damage == "nan":
        state[name] = state[name].clone()
        state[name][0, 0] = float("nan")
    elif damage == "shape":
        state[name] = state[name][:, :-1].contiguous()
    else:
        state["model.layers.1.mlp.bogus.weight"] = torch.zeros(3)  # SGLang would ignore it silently
    with pytest.raises(WeightSyncError, match="nothing was sent"):
        tensor_sync.push(state, [url], "bad")
    assert server_weight_version(url) == "v1"
    _assert_same_outputs(_generate(url, route_spec), disk_outputs["v1"])


def test_sync_failing_midway_marks_the_server_invalid_until_a_full_resync(
    sglang_server, route_spec, model_dir, model_dir_v2, disk_outputs, tensor_sync, monkeypatch
):
    """The transport drops the 2nd bucket after the real server loaded the 1st: half-updated weights."""
    url = sglang_server.url
    real_post, calls = transport.post_admin, []

    def drop_second_bucket(address, endpoint, body, timeout_s, headers=None):
        if endpoint == "update_weights_from_tensor":
            calls.append(endpoint)
            if len(calls) == 2:
                raise WeightSyncError(f"{address}/{endpoint} failed: ReadError: injected connection drop")
        return real_post(address, endpoint, body, timeout_s, headers)

    state = read_hf_state_dict(model_dir_v2)
    monkeypatch.setattr(transport, "post_admin", drop_second_bucket)
    try:
        with pytest.raises(WeightSyncError, match="half-updated and marked invalid.*injected connection drop"):
            tensor_sync.push(state, [url], "v3")
        assert server_weight_version(url) == "v3.partial", "a half-updated server must not pass for any version"
        with pytest.raises(ServerInvalidError, match="refusing rollouts from"):
            tensor_sync.check_servable([url])
        monkeypatch.setattr(transport, "post_admin", real_post)
        tensor_sync.push(state, [url], "v3")  # the full re-sync
        tensor_sync.check_servable([url])
        after = _generate(url, route_spec)
    finally:
        _restore(url, model_dir)
    assert all(s.weight_version == "v3" for s in after)
    _assert_same_outputs(after, disk_outputs["v2"])
    assert not list(Path("/dev/shm").glob(f"torch_{os.getpid()}_*")), "the dropped bucket's /dev/shm file is left"
