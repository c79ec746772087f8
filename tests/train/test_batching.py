"""Records -> learner microbatches and response rows: token/target/mask alignment, routes per input
position, kept sets, and values that survive any regrouping of samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_rl.records import RolloutBatch, RolloutSample
from moe_rl.train.batching import (
    build_microbatch,
    check_ksm_records,
    kept_set_outside_fraction,
    response_row_mask,
    response_rows,
)


def sample(prompt, response, seed, kept_extra=(5,)):
    rng = np.random.default_rng(seed)
    n_rows = len(prompt) + len(response) - 1
    routes = np.stack([[rng.permutation(8)[:2] for _ in range(2)] for _ in range(n_rows)])
    masks = [np.array(sorted({t, *kept_extra}), np.int32) for t in response]
    return RolloutSample(
        np.array(prompt, np.int32),
        np.array(response, np.int32),
        rollout_logp=-np.arange(1, len(response) + 1, dtype=np.float32),
        routes=routes,
        sampling_mask=masks,
        sampling_logp=-np.arange(1, len(response) + 1, dtype=np.float32) / 10,
    )


@pytest.fixture
def batch():
    return RolloutBatch.from_samples([sample([1, 2, 3], [7, 8], 0), sample([1, 4], [9, 10, 11], 1)], num_experts=8)


def test_inputs_targets_and_response_mask_are_shifted_by_one(batch, device):
    mb = build_microbatch(
        batch, [0, 1], torch.tensor([0.5, -0.5]), num_experts=8, kept_logp=False, with_kept_sets=False, device=device
    )
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
    mb = build_microbatch(b, [0, 1], torch.zeros(2), num_experts=8, kept_logp=False, with_kept_sets=False)
    routes, valid = mb.routes.rollout, mb.routes.valid
    assert routes.shape == (2, 5, 2, 2)  # T = 4 + 2 - 1 input positions
    assert torch.equal(routes[0, :2], torch.from_numpy(short.routes).long())  # P + R - 1 = 2 real rows
    assert torch.equal(routes[1], torch.from_numpy(long.routes).long())
    assert valid.tolist() == [[True, True, False, False, False], [True] * 5]
    pads = routes[0, 2:].reshape(-1, 2)
    assert all(len(set(row.tolist())) == 2 for row in pads)  # no duplicate experts in pad rows


def test_keep_sampling_mask_uses_kept_logp_and_counts_sampled_tokens_outside_the_set(device):
    s = sample([1, 2], [7, 8], 5)
    s.sampling_mask[1] = np.array([5, 6], np.int32)  # engine's mask misses the sampled token 8
    b = RolloutBatch.from_samples([s], num_experts=8)
    mb = build_microbatch(b, [0], torch.zeros(1), num_experts=8, kept_logp=True, with_kept_sets=True, device=device)
    assert mb.tensors["rollout_logp"][0].tolist() == pytest.approx([0, -0.1, -0.2])
    assert kept_set_outside_fraction(b) == pytest.approx(1 / 2)
    kept = mb.tensors["kept"]
    sizes = kept.offsets.diff().tolist()
    assert sizes == [0, 2, 2]  # prompt position: full softmax; response positions: their kept sets
    assert kept.ids.tolist() == [5, 7, 5, 6]


def test_response_rows_round_trip_through_any_grouping(batch, device):
    """A per-sample value laid out as response rows is the same whichever microbatch carries it."""
    width = 3
    rows = response_rows(batch, [0, 1], width)
    assert rows.tolist() == [[-1, -2, 0], [-1, -2, -3]]
    assert response_row_mask(batch, [0, 1], width).tolist() == [[True, True, False], [True, True, True]]
    together = build_microbatch(batch, [0, 1], torch.zeros(2), num_experts=8, kept_logp=False, with_kept_sets=False)
    alone = build_microbatch(batch, [1], torch.zeros(2), num_experts=8, kept_logp=False, with_kept_sets=False)
    x = together.from_rows(rows)
    assert torch.equal(x, together.tensors["rollout_logp"])
    assert torch.equal(together.to_rows(x, width), rows)
    assert torch.equal(alone.to_rows(alone.from_rows(rows[1:]), width), rows[1:])
    assert alone.tensors["input_ids"].shape == (1, 4) and together.tensors["input_ids"].shape == (2, 4)


def test_keep_sampling_mask_without_masks_or_kept_logp_in_the_records_is_one_clear_error():
    s = sample([1, 2], [7, 8], 5)
    s.sampling_logp = None
    with pytest.raises(ValueError, match="kept-set log-probs.*return_sampling_mask=true"):
        check_ksm_records(RolloutBatch.from_samples([s], num_experts=8))
    s.sampling_mask = None
    with pytest.raises(ValueError, match="sampling masks .* and the kept-set log-probs"):
        check_ksm_records(RolloutBatch.from_samples([s], num_experts=8))
