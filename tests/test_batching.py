"""Records -> learner microbatches: token/target/mask alignment, routes per input position, kept sets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_rl.batching import build_microbatches, minibatch_split
from moe_rl.records import RolloutBatch, RolloutSample


def sample(prompt, response, seed, kept_extra=(5,)):
    rng = np.random.default_rng(seed)
    n_rows = len(prompt) + len(response) - 1
    routes = np.stack([[rng.permutation(8)[:2] for _ in range(2)] for _ in range(n_rows)])
    masks = [np.array(sorted({t, *kept_extra}), np.int32) for t in response]
    return RolloutSample(np.array(prompt, np.int32), np.array(response, np.int32),
                         rollout_logp=-np.arange(1, len(response) + 1, dtype=np.float32),
                         routes=routes, sampling_mask=masks,
                         sampling_logp=-np.arange(1, len(response) + 1, dtype=np.float32) / 10)  # fmt: skip


@pytest.fixture
def batch():
    return RolloutBatch.from_samples([sample([1, 2, 3], [7, 8], 0), sample([1, 4], [9, 10, 11], 1)], num_experts=8)


def test_inputs_targets_and_response_mask_are_shifted_by_one(batch):
    (mb,) = build_microbatches(batch, [0, 1], torch.tensor([0.5, -0.5]), 8, num_experts=8,
                               use_kept_logp=False, with_routes=True, with_kept_sets=False)  # fmt: skip
    t = mb.tensors
    # sample 0: tokens 1 2 3 7 8 -> input 1 2 3 7, targets 2 3 7 8; response targets at positions 2, 3
    assert t["input_ids"][0].tolist() == [1, 2, 3, 7] and t["targets"][0].tolist() == [2, 3, 7, 8]
    assert t["mask"][0].tolist() == [False, False, True, True]
    # sample 1: tokens 1 4 9 10 11 -> response targets at positions 1, 2, 3
    assert t["input_ids"][1].tolist() == [1, 4, 9, 10] and t["targets"][1].tolist() == [4, 9, 10, 11]
    assert t["mask"][1].tolist() == [False, True, True, True]
    assert t["rollout_logp"][0].tolist() == [0, 0, -1, -2] and t["rollout_logp"][1].tolist() == [0, -1, -2, -3]
    assert t["advantages"].tolist() == [0.5, -0.5]


def test_routes_follow_input_positions_and_padding_gets_distinct_experts():
    short, long = sample([1, 2], [7], 3), sample([1, 2, 3, 4], [7, 8], 4)
    b = RolloutBatch.from_samples([short, long], num_experts=8)
    (mb,) = build_microbatches(b, [0, 1], torch.zeros(2), 8, num_experts=8, use_kept_logp=False,
                               with_routes=True, with_kept_sets=False)  # fmt: skip
    routes, valid = mb.routes.rollout, mb.routes.valid
    assert routes.shape == (2, 5, 2, 2)  # T = 4 + 2 - 1 input positions
    assert torch.equal(routes[0, :2], torch.from_numpy(short.routes).long())  # P + R - 1 = 2 real rows
    assert torch.equal(routes[1], torch.from_numpy(long.routes).long())
    assert valid.tolist() == [[True, True, False, False, False], [True] * 5]
    pads = routes[0, 2:].reshape(-1, 2)
    assert all(len(set(row.tolist())) == 2 for row in pads)  # no duplicate experts in pad rows


def test_keep_sampling_mask_uses_kept_logp_and_counts_sampled_tokens_outside_the_set():
    s = sample([1, 2], [7, 8], 5)
    s.sampling_mask[1] = np.array([5, 6], np.int32)  # engine's mask misses the sampled token 8
    b = RolloutBatch.from_samples([s], num_experts=8)
    (mb,) = build_microbatches(b, [0], torch.zeros(1), 8, num_experts=8, use_kept_logp=True,
                               with_routes=False, with_kept_sets=True)  # fmt: skip
    assert mb.tensors["rollout_logp"][0].tolist() == pytest.approx([0, -0.1, -0.2])
    assert mb.num_outside_mask == 1
    kept = mb.tensors["kept"]
    sizes = kept.offsets.diff().tolist()
    assert sizes == [0, 2, 2]  # prompt position: full softmax; response positions: their kept sets
    assert kept.ids.tolist() == [5, 7, 5, 6]


def test_microbatches_split_samples_and_minibatches_partition_the_batch(batch):
    mbs = build_microbatches(batch, [1, 0], torch.zeros(2), 1, num_experts=8, use_kept_logp=False,
                             with_routes=False, with_kept_sets=False)  # fmt: skip
    assert [m.tensors["sample_ids"] for m in mbs] == [[1], [0]]
    parts = minibatch_split(8, 4, np.random.default_rng(0))
    assert sorted(np.concatenate(parts).tolist()) == list(range(8)) and {len(p) for p in parts} == {2}
    with pytest.raises(ValueError, match="minibatches_per_step=3 must divide the 8 samples"):
        minibatch_split(8, 3, np.random.default_rng(0))
