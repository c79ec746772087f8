"""Records format 4: multi-turn trajectories (role mask, loss mask, turn ids) round trip, are checked, read per rank,
show in ``moe-rl records inspect``; older records (formats 2-3, and single-turn format 4) read as before."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from moe_rl.cli import main
from moe_rl.records import RecordError, RolloutBatch, RolloutSample
from moe_rl.records.share import load_share
from moe_rl.records.trajectory import TRAJECTORY_ARRAYS
from moe_rl.train.batching import response_row_mask
from tests.records.test_records_chunks import FORMAT2, STEP0

EXPERTS = 8


def _routes(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(EXPERTS, 2, replace=False) for _ in range(2)] for _ in range(rows)]).astype(np.int32)


def _trajectory(seed: int) -> RolloutSample:
    """prompt 3 | turn 1: 2 generated | 3 environment | turn 2: 2 generated."""
    role = np.array([1, 1, 0, 0, 0, 1, 1], np.uint8)
    kept = [np.array([4, 9], np.int32), np.array([5], np.int32)] + [np.zeros(0, np.int32)] * 3
    kept += [np.array([8, 1, 2], np.int32), np.array([9], np.int32)]
    return RolloutSample(
        prompt_ids=np.array([1, 2, 3], np.int32),
        response_ids=np.array([4, 5, 20, 21, 22, 8, 9], np.int32),
        rollout_logp=np.where(role == 1, -0.25, 0.0).astype(np.float32),
        routes=_routes(3 + 7 - 1, seed),
        sampling_mask=kept,
        sampling_logp=np.where(role == 1, -0.125, 0.0).astype(np.float32),
        weight_version="step-3",
        finish_reason="stop",
        token_versions=np.array([2, 2, -1, -1, -1, 3, 3], np.int32),
        role_mask=role,
        loss_mask=role.copy(),
        turn_ids=np.array([1, 1, 1, 1, 1, 2, 2], np.int32),
    )


def _single(seed: int) -> RolloutSample:
    return RolloutSample(
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.array([6, 7, 8], np.int32),
        rollout_logp=np.full(3, -0.5, np.float32),
        routes=_routes(2 + 3 - 1, seed),
        sampling_mask=[np.array([6], np.int32), np.array([7], np.int32), np.array([8, 1], np.int32)],
        sampling_logp=np.full(3, -0.25, np.float32),
        weight_version="step-3",
        finish_reason="length",
    )


def _batch() -> RolloutBatch:
    return RolloutBatch.from_samples([_trajectory(0), _single(1), _trajectory(2)], num_experts=EXPERTS)


def test_a_trajectory_batch_round_trips_and_reads_per_rank(tmp_path):
    batch = _batch()
    path = batch.save(tmp_path / "step_000000.safetensors")
    back = RolloutBatch.load(path)
    assert back.format_version == 4
    for name in (*TRAJECTORY_ARRAYS, "routes", "mask_ids", "mask_offsets", "rollout_logp", "token_versions"):
        np.testing.assert_array_equal(getattr(back, name), getattr(batch, name), err_msg=name)
    assert back.role_mask[7:10].tolist() == [1, 1, 1]  # a single-turn sample among trajectories: one generated turn
    assert back.turn_ids[7:10].tolist() == [1, 1, 1]
    s = back.sample(2)
    assert s.turn_ids.tolist() == [1, 1, 1, 1, 1, 2, 2] and s.loss_mask.tolist() == [1, 1, 0, 0, 0, 1, 1]
    # a rank's share: the masks come along even when the caller lists only μ as shared
    share = load_share(path, [2], shared=("sampling_logp",)).batch
    np.testing.assert_array_equal(share.loss_mask, batch.loss_mask)
    assert [len(m) for m in share.sample(2).sampling_mask] == [2, 1, 0, 0, 0, 3, 1]
    # the learner's mask: generated tokens only
    rows = response_row_mask(share, [2], 7)
    assert rows[0].tolist() == [True, True, False, False, False, True, True]


def test_old_and_single_turn_records_read_as_before(tmp_path, capsys):
    for path, version in ((FORMAT2, 2), (STEP0, 3)):
        old = RolloutBatch.load(path)
        assert old.format_version == version and all(getattr(old, k) is None for k in TRAJECTORY_ARRAYS)
        ids = list(range(len(old)))
        width = int(old.response_lens.max())
        rows = response_row_mask(old, ids, width)
        assert rows.sum() == old.response_lens.sum()  # every response token trains, as before
        assert main(["records", "inspect", str(path)]) == 0
        assert "turns" not in json.loads(capsys.readouterr().out)
    single = RolloutBatch.from_samples([_single(0), _single(1)], num_experts=EXPERTS)
    path = single.save(tmp_path / "single.safetensors")
    assert RolloutBatch.load(path).format_version == 4
    assert not set(load_file(path)) & set(TRAJECTORY_ARRAYS)  # stored as in format 3: no trajectory arrays


def test_inspect_shows_turns(tmp_path, capsys):
    path = _batch().save(tmp_path / "step_000000.safetensors")
    assert main(["records", "inspect", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format_version"] == 4 and out["turns"] == {"min": 1, "max": 2, "mean": 5 / 3}
    assert (out["multi_turn_samples"], out["environment_tokens"], out["loss_tokens"]) == (2, 6, 11)
    assert out["sample_0_segments"] == [
        ["prompt", 3, 0],
        ["generated", 2, 1],
        ["environment", 3, 1],
        ["generated", 2, 2],
    ]
    assert out["token_versions"] == [2, 3] and out["mask_size_min"] == 1  # generated tokens only


def _broken(name: str, value, at: int = 2) -> RolloutBatch:
    batch = _batch()
    if name == "mask":  # the first environment token given a kept set
        batch.mask_ids = np.insert(batch.mask_ids, batch.mask_offsets[at], 20)
        batch.mask_offsets[at + 1 :] += 1
        return batch
    if name == "drop":
        setattr(batch, value, None)
        return batch
    getattr(batch, name)[at] = value
    return batch


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("loss_mask", 1, "loss_mask is 1 on environment token 2: environment tokens are never trained on"),
        ("rollout_logp", -0.5, "rollout_logp is not 0 on environment token 2: it has no behaviour log-prob"),
        ("sampling_logp", -0.5, "sampling_logp is not 0 on environment token 2"),
        ("token_versions", 3, "token_versions is not -1 on environment token 2"),
        ("mask", None, "environment token 2 has a kept set"),
        ("turn_ids", 0, r"sample 0: turn_ids must start at >= 1 and never decrease"),
        ("role_mask", 2, "role_mask must hold 0 or 1"),
        ("drop", "turn_ids", "role_mask, loss_mask, turn_ids must be stored together"),
    ],
)
def test_bad_trajectory_arrays_are_refused_naming_the_field(tmp_path, name, value, match):
    batch = _broken(name, value)
    with pytest.raises(RecordError, match=match) as info:
        batch.validate()
    assert "\n" not in str(info.value)
    with pytest.raises(RecordError, match=match):  # never written either way: the file is checked on load
        RolloutBatch.load(batch.save(tmp_path / "bad.safetensors"))
