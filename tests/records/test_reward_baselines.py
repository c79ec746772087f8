"""ReMax's ``reward_baselines`` in the records: built from the samples, saved, loaded, shared; bad ones refused.

The rollout gives every sampled response the reward of its prompt's greedy response (``RolloutSample.
reward_baseline``); ``RolloutBatch.from_samples`` stores them, rounded to float32 as ``rewards`` are (so r − b is
exactly 0 for an equal reward), in ``extra["reward_baselines"]``, which every rank reads with the header.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_rl.records import RecordError, RolloutBatch
from tests.train.records_fixture import RECORDS


@pytest.fixture
def batch():
    return RolloutBatch.load(min(RECORDS.glob("step_*.safetensors")))


def test_baselines_round_trip_through_samples_and_the_file(batch, tmp_path):
    assert batch.reward_baselines() is None  # records made without remax carry none
    samples = batch.samples()
    for s in samples:
        s.reward_baseline = 0.1 * (s.group_id + 1)  # 0.1 is not a float32: stored rounded as rewards are
    built = RolloutBatch.from_samples(samples, batch.num_experts)
    want = np.float32([0.1 * (s.group_id + 1) for s in samples]).astype(np.float64)
    assert np.array_equal(built.reward_baselines(), want)
    loaded = RolloutBatch.load(built.save(tmp_path / "step_000000.safetensors"))
    assert np.array_equal(loaded.reward_baselines(), want)
    assert loaded.sample(3).reward_baseline == want[3]
    assert np.array_equal(loaded.select([2, 0]).reward_baselines(), want[[2, 0]])


def test_every_sample_or_none_carries_a_baseline(batch):
    samples = batch.samples()
    samples[0].reward_baseline = 1.0
    with pytest.raises(RecordError, match="either every sample or none carries a reward_baseline"):
        RolloutBatch.from_samples(samples, batch.num_experts)


@pytest.mark.parametrize(
    "bad", [lambda n: [0.0], lambda n: "x", lambda n: [float("nan")] * n, lambda n: [None] * n, lambda n: [[1.0]] * n]
)
def test_bad_baselines_are_refused_in_one_line(batch, bad):
    batch.extra["reward_baselines"] = bad(len(batch))  # wrong length, not numbers, not finite, nested
    with pytest.raises(RecordError, match=r"extra.reward_baselines must hold one finite number per sample \(\d+\)"):
        batch.validate()
