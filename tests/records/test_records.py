"""Rollout records: SGLang meta_info decoding (off-by-one, dense layers), compact storage, validation, I/O."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from moe_rl.cli import main
from moe_rl.config import ModelConfig
from moe_rl.records import (
    RecordError,
    RolloutBatch,
    RolloutSample,
    RouteSpec,
    decode_sglang_meta,
    pad_routes,
    route_dtype,
    wire_to_routes,
)

# 3 layers, layer 0 dense (Qwen3 mlp_only_layers=[0]): the wire carries zeros for it.
MODEL = ModelConfig(num_layers=3, first_k_dense_layers=1, num_moe_experts=8, moe_router_topk=2, vocab_size=64)
SPEC = RouteSpec.from_model_config(MODEL)


def sglang_meta(prompt_len, response_ids, moe_routes, *, drop_last_row=True, with_masks=True):
    """A reply built the way SGLang builds it: int32 [seqlen-1, num_hidden_layers, top_k], dense layer zero."""
    seq_rows = prompt_len + len(response_ids) - (1 if drop_last_row else 0)
    wire = np.zeros((seq_rows, MODEL.num_layers, MODEL.moe_router_topk), dtype="<i4")
    wire[:, 1:, :] = moe_routes[:seq_rows]
    meta = {
        "routed_experts": base64.b64encode(wire.tobytes()).decode(),
        "output_token_logprobs": [[-0.25 * (t + 1), int(tok), None] for t, tok in enumerate(response_ids)],
        "weight_version": "v3",
        "finish_reason": {"type": "stop"},
    }
    if with_masks:
        meta["output_token_sampling_mask"] = [[int(tok), 5, 6] for tok in response_ids]
        meta["output_token_sampling_logprobs"] = [-0.125 * (t + 1) for t in range(len(response_ids))]
    return meta


def distinct_routes(rows, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([[rng.permutation(8)[:2] for _ in range(2)] for _ in range(rows)]).astype(np.int64)


def test_decode_drops_dense_layer_and_has_no_row_for_last_token():
    prompt_len, response = 4, np.array([9, 10, 11], np.int32)
    moe = distinct_routes(prompt_len + len(response))
    decoded = decode_sglang_meta(sglang_meta(prompt_len, response, moe), prompt_len, response, SPEC, vocab_size=64)
    # rows = P + R - 1 (no row for the last generated token); only the 2 MoE layers kept
    assert decoded.routes.shape == (6, 2, 2)
    assert decoded.routes.dtype == np.uint8
    np.testing.assert_array_equal(decoded.routes, moe[:6])
    np.testing.assert_array_equal(decoded.rollout_logp, np.float32([-0.25, -0.5, -0.75]))
    assert [m.tolist() for m in decoded.sampling_mask] == [[9, 5, 6], [10, 5, 6], [11, 5, 6]]
    np.testing.assert_array_equal(decoded.sampling_logp, np.float32([-0.125, -0.25, -0.375]))
    assert (decoded.weight_version, decoded.finish_reason) == ("v3", "stop")


def test_decode_rejects_a_reply_with_a_row_for_the_last_token():
    prompt_len, response = 4, np.array([9, 10, 11], np.int32)
    meta = sglang_meta(prompt_len, response, distinct_routes(7), drop_last_row=False)
    with pytest.raises(RecordError, match="routed_experts has 168 bytes = 7 rows .* expected 6 rows"):
        decode_sglang_meta(meta, prompt_len, response, SPEC)


def test_missing_routes_name_the_request_field_and_server_flag():
    meta = sglang_meta(2, np.array([3]), distinct_routes(2))
    del meta["routed_experts"]
    with pytest.raises(RecordError, match="return_routed_experts=true .* --enable-return-routed-experts"):
        decode_sglang_meta(meta, 2, np.array([3]), SPEC)


def test_start_len_shortens_the_expected_rows():
    prompt_len, response = 5, np.array([7, 8], np.int32)
    moe = distinct_routes(prompt_len + 2)
    wire = np.zeros((6 - 2, 3, 2), "<i4")
    wire[:, 1:] = moe[2:6]
    meta = sglang_meta(prompt_len, response, moe)
    meta["routed_experts"] = base64.b64encode(wire.tobytes()).decode()
    decoded = decode_sglang_meta(meta, prompt_len, response, SPEC, start_len=2)
    np.testing.assert_array_equal(decoded.routes, moe[2:6])
    with pytest.raises(RecordError, match=r"routed_experts_start_len=6 must be in \[0, prompt_len=5\]"):
        decode_sglang_meta(meta, prompt_len, response, SPEC, start_len=6)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda m: m["output_token_logprobs"].__setitem__(1, [float("nan"), 10, None]),
            r"output_token_logprobs\[1\] = nan",
        ),
        (
            lambda m: m["output_token_logprobs"].pop(),
            "output_token_logprobs has 2 entries; expected one per response token",
        ),
        (
            lambda m: m["output_token_logprobs"].__setitem__(0, [-1.0, 42, None]),
            "is for token 42, but response token 0 is 9",
        ),
        (lambda m: m.pop("output_token_logprobs"), "return_logprob=true"),
        (
            lambda m: m["output_token_sampling_mask"].__setitem__(2, []),
            r"output_token_sampling_mask\[2\] must be a non-empty",
        ),
        (
            lambda m: m["output_token_sampling_mask"].__setitem__(2, [99]),
            r"output_token_sampling_mask\[2\] has ids outside",
        ),
        (
            lambda m: m["output_token_sampling_logprobs"].__setitem__(1, None),
            r"output_token_sampling_logprobs\[1\] = None",
        ),
        (lambda m: m["output_token_sampling_logprobs"].pop(), "output_token_sampling_logprobs has 2 entries"),
        (lambda m: m["output_token_sampling_logprobs"].__setitem__(0, "x"), "must hold one number per response token"),
    ],
)
def test_malformed_meta_info_gives_one_clear_error(mutate, message):
    response = np.array([9, 10, 11], np.int32)
    meta = sglang_meta(4, response, distinct_routes(7))
    mutate(meta)
    with pytest.raises(RecordError, match=message):
        decode_sglang_meta(meta, 4, response, SPEC, vocab_size=64)


def test_expert_out_of_range_and_duplicates_are_rejected():
    response = np.array([9], np.int32)
    bad = distinct_routes(3)
    bad[1, 0, 0] = 8
    with pytest.raises(RecordError, match=r"expert ids must be in \[0, 8\), got range \[\d, 8\]"):
        decode_sglang_meta(sglang_meta(3, response, bad), 3, response, SPEC)
    dup = distinct_routes(3)
    dup[2, 1] = [4, 4]
    with pytest.raises(RecordError, match=r"routed_experts\[2, 1\] repeats an expert: \[4, 4\]"):
        decode_sglang_meta(sglang_meta(3, response, dup), 3, response, SPEC)


def test_pad_rows_have_distinct_experts_and_spread_load():
    pads = pad_routes(num_rows=64, num_layers=3, top_k=4, num_experts=16)
    assert pads.dtype == np.uint8
    assert all(len(set(row)) == 4 for row in pads.reshape(-1, 4).tolist())
    counts = np.bincount(pads.ravel(), minlength=16)
    assert counts.min() == counts.max() == 64 * 3 * 4 // 16  # perfectly even, never all on expert 0


@given(st.integers(1, 70000))
def test_route_dtype_is_smallest_that_fits(num_experts):
    if num_experts > 65536:
        with pytest.raises(RecordError):
            route_dtype(num_experts)
        return
    dtype = route_dtype(num_experts)
    assert np.iinfo(dtype).max >= num_experts - 1
    assert dtype.itemsize == (1 if num_experts <= 256 else 2)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 20),
    layers=st.integers(1, 4),
    top_k=st.integers(1, 4),
    num_experts=st.sampled_from([4, 8, 256, 257, 1000]),
    dense_first=st.booleans(),
    data=st.data(),
)
def test_wire_decode_inverts_int32_encoding(rows, layers, top_k, num_experts, dense_first, data):
    ids = data.draw(
        st.lists(st.integers(0, num_experts - 1), min_size=rows * layers * top_k, max_size=rows * layers * top_k)
    )
    routes = np.array(ids, dtype=np.int64).reshape(rows, layers, top_k)
    hidden = layers + int(dense_first)
    moe_ids = list(range(int(dense_first), hidden))
    wire = np.zeros((rows, hidden, top_k), "<i4")
    wire[:, moe_ids] = routes
    decoded = wire_to_routes(wire.tobytes(), rows, hidden, top_k, moe_ids, num_experts)
    assert decoded.dtype == route_dtype(num_experts)
    np.testing.assert_array_equal(decoded.astype(np.int64), routes)


def make_sample(prompt_len, response_len, seed, with_routes=True):
    rng = np.random.default_rng(seed)
    response = rng.integers(0, 64, response_len).astype(np.int32)
    return RolloutSample(
        prompt_ids=rng.integers(0, 64, prompt_len).astype(np.int32),
        response_ids=response,
        rollout_logp=-rng.random(response_len).astype(np.float32),
        routes=distinct_routes(prompt_len + response_len - 1, seed) if with_routes else None,
        sampling_mask=[np.unique(np.r_[tok, rng.integers(0, 64, seed % 4)]).astype(np.int32) for tok in response],
        sampling_logp=-rng.random(response_len).astype(np.float32) / 2,
        reward=float(seed),
        group_id=seed // 2,
        weight_version=f"v{seed}",
        finish_reason="length",
    )


def test_batch_save_load_round_trip(tmp_path):
    samples = [make_sample(3 + i, 2 + i, i) for i in range(5)]
    batch = RolloutBatch.from_samples(samples, num_experts=8)
    batch.validate(MODEL)
    loaded = RolloutBatch.load(batch.save(tmp_path / "step_0.safetensors"))
    for original, back in zip(samples, loaded.samples(), strict=True):
        np.testing.assert_array_equal(back.prompt_ids, original.prompt_ids)
        np.testing.assert_array_equal(back.response_ids, original.response_ids)
        np.testing.assert_array_equal(back.rollout_logp, original.rollout_logp)
        np.testing.assert_array_equal(back.routes.astype(np.int64), original.routes)
        assert [m.tolist() for m in back.sampling_mask] == [m.tolist() for m in original.sampling_mask]
        np.testing.assert_array_equal(back.sampling_logp, original.sampling_logp)
        assert (back.reward, back.group_id, back.weight_version) == (
            original.reward,
            original.group_id,
            original.weight_version,
        )
    assert loaded.routes.dtype == np.uint8
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write left no temp file


def test_select_reorders_samples():
    batch = RolloutBatch.from_samples([make_sample(3, 2, i) for i in range(4)], num_experts=8)
    picked = batch.select([3, 1])
    assert picked.rewards.tolist() == [3.0, 1.0]
    np.testing.assert_array_equal(picked.sample(0).routes, batch.sample(3).routes)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b.rollout_logp.__setitem__(3, np.nan), "rollout_logp has 1 non-finite values"),
        (lambda b: setattr(b, "routes", b.routes[:, :1]), r"routes has shape \(\d+, 1, 2\): .* 1 MoE layers"),
        (lambda b: setattr(b, "routes", b.routes[:-1]), "expected one per forwarded position"),
        (lambda b: b.routes.__setitem__((0, 0), [3, 3]), r"routes\[0, 0\] repeats an expert"),
        (lambda b: b.response_ids.__setitem__(0, 64), r"response_ids must be in \[0, model.vocab_size=64\)"),
        (lambda b: setattr(b, "num_experts", 16), "records were made for 16 experts"),
        (lambda b: setattr(b, "rewards", b.rewards[:-1]), "rewards has 2 entries; expected one per sample"),
    ],
)
def test_validation_against_model_names_the_field(change, message):
    batch = RolloutBatch.from_samples([make_sample(3, 2, i) for i in range(3)], num_experts=8)
    change(batch)
    with pytest.raises(RecordError, match=message):
        batch.validate(MODEL)


def test_load_rejects_a_foreign_safetensors_file(tmp_path):
    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(RecordError, match="not a moe_rl records file"):
        RolloutBatch.load(tmp_path / "other.safetensors")


def test_mixed_route_presence_is_rejected():
    with pytest.raises(RecordError, match="either every sample or none carries routes"):
        RolloutBatch.from_samples([make_sample(3, 2, 0), make_sample(3, 2, 1, with_routes=False)], num_experts=8)


def test_records_inspect_cli(tmp_path, capsys):
    path = RolloutBatch.from_samples([make_sample(3, 2, i) for i in range(3)], num_experts=8).save(
        tmp_path / "r.safetensors"
    )
    assert main(["records", "inspect", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples"] == 3 and summary["bytes_per_route_entry"] == 1
    assert summary["route_bytes_int32_wire"] == 4 * summary["route_bytes"]
