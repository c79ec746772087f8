"""Records' per-token weight versions (``token_versions``): stored, checked, and defaulted for older records."""

import numpy as np
import pytest

from moe_rl.records import RecordError, RolloutBatch, RolloutSample
from moe_rl.records.summary import batch_summary
from moe_rl.records.versions import token_versions_of, version_number


def _sample(r: int, label: str, versions=None) -> RolloutSample:
    return RolloutSample(
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.arange(3, 3 + r, dtype=np.int32),
        rollout_logp=np.full(r, -0.5, np.float32),
        weight_version=label,
        finish_reason="stop",
        token_versions=None if versions is None else np.asarray(versions, np.int32),
    )


def test_samples_without_arrays_get_their_label_version_on_every_token(tmp_path):
    batch = RolloutBatch.from_samples([_sample(2, "step-3-abc"), _sample(3, "step-4")])
    assert batch.token_versions.tolist() == [3, 3, 4, 4, 4]
    back = RolloutBatch.load(batch.save(tmp_path / "r.safetensors"))
    assert back.token_versions.dtype == np.int32 and back.token_versions.tolist() == [3, 3, 4, 4, 4]
    assert back.sample(1).token_versions.tolist() == [4, 4, 4]


def test_a_sample_spanning_two_versions_keeps_its_tokens_versions(tmp_path):
    batch = RolloutBatch.from_samples([_sample(3, "step-5", [4, 4, 5]), _sample(1, "step-5")])
    back = RolloutBatch.load(batch.save(tmp_path / "r.safetensors"))
    assert back.token_versions.tolist() == [4, 4, 5, 5]
    assert batch_summary(back)["token_versions"] == [4, 5] and batch_summary(back)["partial_samples"] == 1


def test_records_without_the_array_load_at_the_sample_version(tmp_path):
    batch = RolloutBatch.from_samples([_sample(2, "step-7-x1"), _sample(1, "step-6-x1")])
    batch.token_versions = None  # as a file written before the array existed
    back = RolloutBatch.load(batch.save(tmp_path / "old.safetensors"))
    assert back.token_versions is None
    assert token_versions_of(back).tolist() == [7, 7, 6]


def test_hand_made_labels_store_no_versions():
    batch = RolloutBatch.from_samples([_sample(2, "v0"), _sample(1, "step-1")])
    assert batch.token_versions is None and token_versions_of(batch) is None


@pytest.mark.parametrize(
    "versions, match",
    [
        ([0, 1], "one entry per response token"),
        ([0, -1, 0], "negative version"),
        ([2, 3, 2], "newer than its weight_version"),
    ],
)
def test_bad_token_versions_are_refused_naming_the_field(versions, match):
    batch = RolloutBatch.from_samples([_sample(3, "step-2")])
    batch.token_versions = np.asarray(versions, np.int32)
    with pytest.raises(RecordError, match=match):
        batch.validate()


def test_label_version_numbers():
    assert version_number("step-12") == 12 and version_number("step-12-ab3") == 12
