"""Both wire forms of routes and kept sets decode to the same records; bad replies give one clear error.

Expected values are built here from known arrays (never by the decoder under test).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from moe_rl.config import load_config
from moe_rl.learner.hf_stream import size_buckets
from moe_rl.records import RecordError, RouteSpec, decode_sglang_meta
from moe_rl.records.sglang_meta import decode_routes, decode_sampling_mask
from moe_rl.sync.checks import check_weights
from moe_rl.sync.transport import WeightSyncError, is_local_address
from moe_rl.sync.weight_sync import WeightSync

SPEC = RouteSpec(num_hidden_layers=3, moe_layer_ids=(1, 2), top_k=2, num_experts=8)  # layer 0 dense


def _routes(rows: int, spec: RouteSpec = SPEC, seed: int = 0) -> np.ndarray:
    """[rows, L_moe, K] distinct experts per (row, layer)."""
    rng = np.random.default_rng(seed)
    keys = rng.random((rows, len(spec.moe_layer_ids), spec.num_experts))
    return np.argsort(keys, axis=-1)[..., : spec.top_k]


def _wire(routes: np.ndarray, dtype: str, spec: RouteSpec = SPEC) -> str:
    full = np.zeros((routes.shape[0], spec.num_hidden_layers, spec.top_k), dtype=dtype)
    full[:, list(spec.moe_layer_ids)] = routes
    return base64.b64encode(full.tobytes()).decode()


@pytest.mark.parametrize("dtype", ["int32", "uint8", "uint16"])
def test_every_route_wire_dtype_decodes_to_the_same_compact_routes(dtype, device):
    expected = _routes(7 + 4 - 1)
    meta = {"routed_experts": _wire(expected, "<i4" if dtype == "int32" else dtype)}
    if dtype != "int32":  # the patched server states its dtype; upstream sends int32 without the field
        meta["routed_experts_dtype"] = dtype
    got = decode_routes(meta, prompt_len=7, response_len=4, spec=SPEC)
    assert got.dtype == np.uint8 and got.flags.writeable
    torch.testing.assert_close(torch.from_numpy(got.astype(np.int64)).to(device), torch.from_numpy(expected).to(device))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: m.update(routed_experts_dtype="float16"), r"routed_experts_dtype='float16'; expected one of"),
        (
            lambda m: m.update(routed_experts_dtype="uint16"),
            r"60 bytes = 5 rows .* uint16; expected 10 rows .* = 120 bytes",
        ),
        (lambda m: m.update(routed_experts=m["routed_experts"][:-8]), r"routed_experts has \d+ bytes"),
        (lambda m: m.update(routed_experts=_wire(np.full((10, 2, 2), 9), "uint8")), r"expert ids must be in \[0, 8\)"),
        (lambda m: m.update(routed_experts="@@not base64@@"), r"routed_experts is not valid base64"),
    ],
    ids=["unknown-dtype", "wrong-dtype", "wrong-size", "expert-out-of-range", "not-base64"],
)
def test_bad_routes_give_one_clear_error(mutate, message):
    meta = {"routed_experts": _wire(_routes(10), "uint8"), "routed_experts_dtype": "uint8"}
    mutate(meta)
    with pytest.raises(RecordError, match=message):
        decode_routes(meta, prompt_len=7, response_len=4, spec=SPEC)


def test_uint8_wire_for_more_than_256_experts_is_refused():
    spec = RouteSpec(num_hidden_layers=1, moe_layer_ids=(0,), top_k=2, num_experts=300)
    meta = {"routed_experts": base64.b64encode(bytes(4)).decode(), "routed_experts_dtype": "uint8"}
    with pytest.raises(RecordError, match="uint8 cannot hold ids of 300 experts"):
        decode_routes(meta, prompt_len=2, response_len=1, spec=spec)


def test_incremental_routes_decode_only_rows_from_start_len():
    expected = _routes(7 + 4 - 1)
    meta = {"routed_experts": _wire(expected[5:], "uint8"), "routed_experts_dtype": "uint8"}
    np.testing.assert_array_equal(decode_routes(meta, 7, 4, SPEC, start_len=5), expected[5:])
    with pytest.raises(RecordError, match="= 5 rows .* expected 10 rows"):
        decode_routes(meta, 7, 4, SPEC, start_len=0)


def _kept_sets(response_len: int, vocab: int = 512) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.choice(vocab, size=int(rng.integers(1, 20)), replace=False) for _ in range(response_len)]


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_compact_kept_sets_equal_the_list_form(dtype):
    kept = _kept_sets(6)
    compact = {
        "output_token_sampling_mask_ids": base64.b64encode(np.concatenate(kept).astype(dtype).tobytes()).decode(),
        "output_token_sampling_mask_dtype": dtype,
        "output_token_sampling_mask_lengths": [len(k) for k in kept],
    }
    listed = {"output_token_sampling_mask": [k.tolist() for k in kept]}
    for meta in (compact, listed):
        got = decode_sampling_mask(meta, 6, vocab_size=512)
        assert len(got) == 6
        for g, k in zip(got, kept):
            assert g.dtype == np.int32
            np.testing.assert_array_equal(g, k)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: m.update(output_token_sampling_mask_lengths=[3, 3]), r"has 2 entries; expected one per response"),
        (lambda m: m.update(output_token_sampling_mask_lengths=[3, 3, 3]), r"holds 10 ids but .* sums to 9"),
        (lambda m: m.update(output_token_sampling_mask_lengths=[10, 0, 0]), r"lengths\[1\] = 0; every kept set"),
        (lambda m: m.update(output_token_sampling_mask_dtype="int8"), r"mask_dtype='int8'; expected one of"),
        (lambda m: m.pop("output_token_sampling_mask_lengths"), r"no output_token_sampling_mask_lengths"),
    ],
)
def test_bad_compact_kept_sets_give_one_clear_error(mutate, message):
    ids = np.arange(10, dtype="<u2")
    meta = {
        "output_token_sampling_mask_ids": base64.b64encode(ids.tobytes()).decode(),
        "output_token_sampling_mask_dtype": "uint16",
        "output_token_sampling_mask_lengths": [3, 3, 4],
    }
    mutate(meta)
    with pytest.raises(RecordError, match=message):
        decode_sampling_mask(meta, 3, vocab_size=512)


def test_kept_id_outside_the_vocabulary_names_the_token():
    ids = np.array([1, 2, 3, 4, 600, 5], dtype="<u2")
    meta = {
        "output_token_sampling_mask_ids": base64.b64encode(ids.tobytes()).decode(),
        "output_token_sampling_mask_dtype": "uint16",
        "output_token_sampling_mask_lengths": [2, 3, 1],
    }
    with pytest.raises(RecordError, match=r"output_token_sampling_mask\[1\] has ids outside \[0, 512\)"):
        decode_sampling_mask(meta, 3, vocab_size=512)


def test_whole_meta_with_compact_fields_decodes(device):
    response = np.array([11, 12, 13])
    kept = [np.array([11, 40]), np.array([12]), np.array([13, 7, 8])]
    meta = {
        "output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None], [-1.0, 13, None]],
        "routed_experts": _wire(_routes(4 + 3 - 1), "uint8"),
        "routed_experts_dtype": "uint8",
        "output_token_sampling_mask_ids": base64.b64encode(np.concatenate(kept).astype("<u2").tobytes()).decode(),
        "output_token_sampling_mask_dtype": "uint16",
        "output_token_sampling_mask_lengths": [2, 1, 3],
        "output_token_sampling_logprobs": [-0.1, 0.0, -0.7],
        "weight_version": "v3",
    }
    d = decode_sglang_meta(meta, 4, response, SPEC, vocab_size=512)
    assert d.routes.shape == (6, 2, 2) and d.weight_version == "v3"
    assert [m.tolist() for m in d.sampling_mask] == [[11, 40], [12], [13, 7, 8]]
    torch.testing.assert_close(
        torch.from_numpy(d.rollout_logp).to(device), torch.tensor([-0.5, -0.25, -1.0], device=device)
    )


def test_weights_that_do_not_match_the_served_model_are_refused_before_sending(device):
    reference = {"a.weight": (2, 3), "b.weight": (4,)}
    good = {"a.weight": torch.zeros(2, 3, device=device), "b.weight": torch.ones(4, device=device)}
    check_weights(good, reference)
    with pytest.raises(WeightSyncError, match=r"1 missing \(e.g. \['b.weight'\]\), 1 unknown .*nothing was sent"):
        check_weights({"a.weight": good["a.weight"], "c.weight": good["b.weight"]}, reference)
    with pytest.raises(WeightSyncError, match=r"a.weight has shape \(3, 2\), the served model has \(2, 3\)"):
        check_weights({**good, "a.weight": torch.zeros(3, 2, device=device)}, reference)
    with pytest.raises(WeightSyncError, match="b.weight holds NaN or Inf"):
        check_weights({**good, "b.weight": torch.tensor([1.0, float("nan"), 0, 0], device=device)}, reference)


def test_buckets_keep_order_and_size_limit():
    named = {f"t{i}": torch.zeros(n) for i, n in enumerate([10, 10, 30, 5, 5])}  # float32: 4 bytes each
    groups = size_buckets(named, bucket_bytes=80)
    assert [[n for n, _ in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_only_loopback_addresses_count_as_this_host():
    assert is_local_address("http://127.0.0.1:30000") and is_local_address("http://localhost:1")
    assert not is_local_address("http://10.1.2.3:30000")


def test_weight_sync_mode_follows_the_config_and_the_server_hosts(tiny_hf_dir):
    local, remote = ["http://127.0.0.1:30000"], ["http://10.1.2.3:30000"]
    cfg = load_config(None, [f"checkpoint.init_from_hf={tiny_hf_dir}"])
    assert cfg.rollout.weight_sync == "auto"
    assert WeightSync.from_config(cfg, local).mode == "tensor"
    assert WeightSync.from_config(cfg, remote, export_dir="/tmp/x").mode == "disk"
    assert WeightSync.from_config(cfg, local).reference["lm_head.weight"] == (512, 64)
    with pytest.raises(
        ValueError, match=r"rollout.weight_sync='tensor' .* \['http://10.1.2.3:30000'\] are not on this host"
    ):
        WeightSync.from_config(load_config(None, ["rollout.weight_sync=tensor"]), remote)
    with pytest.raises(ValueError, match="rollout.weight_sync='disk' needs an export_dir"):
        WeightSync.from_config(load_config(None, ["rollout.weight_sync=disk"]), local)
