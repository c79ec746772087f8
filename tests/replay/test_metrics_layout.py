"""Flip-rate math and route layout conversions, checked against hand-built cases."""

import numpy as np
import pytest
import torch

from moe_rl.replay.layout import (
    check_routes,
    context_parallel_shard,
    from_megatron_layout,
    pack_microbatch_routes,
    sequence_parallel_shard,
    to_megatron_layout,
)
from moe_rl.replay.metrics import FlipCounter, expert_set_flips


def test_set_comparison_ignores_order():
    a = torch.tensor([[[0, 1], [2, 3]]])
    b = torch.tensor([[[1, 0], [2, 4]]])
    assert expert_set_flips(a, b).tolist() == [[False, True]]


def test_flip_counter_hand_computed():
    # 1 sample, 3 positions (last one padding), 2 layers, top-2
    ref = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [0, 1]]]])
    oth = torch.tensor([[[[1, 0], [2, 5]], [[4, 5], [6, 7]], [[2, 3], [2, 3]]]])
    valid = torch.tensor([[True, True, False]])
    c = FlipCounter("natural", layer_ids=[0, 3])
    c.add(ref, oth, valid)
    s = c.summary()
    # flips only at (pos 0, layer 1): 1 of 4 token-layers, 1 of 2 tokens, layer3 rate 1/2
    assert s["natural/flip_rate"] == pytest.approx(0.25)
    assert s["natural/tokens_with_flip"] == pytest.approx(0.5)
    assert s["natural/flip_rate/layer0"] == 0.0
    assert s["natural/flip_rate/layer3"] == pytest.approx(0.5)


def test_megatron_layout_is_sequence_major():
    B, S, L, K = 2, 3, 2, 2
    routes = torch.arange(B * S * L * K).view(B, S, L, K)
    per_layer = to_megatron_layout(routes)
    assert per_layer.dtype == torch.int64 and per_layer.shape == (L, S * B, K)
    for b in range(B):
        for s in range(S):
            for layer in range(L):
                assert per_layer[layer, s * B + b].tolist() == routes[b, s, layer].tolist()
    assert torch.equal(from_megatron_layout(per_layer, B), routes)


def test_pack_pads_with_distinct_spread_experts():
    E, K, L = 8, 2, 2
    r0 = np.array([[[0, 1], [2, 3]]] * 3, dtype=np.uint8)  # 3 rows
    r1 = np.array([[[4, 5], [6, 7]]] * 5, dtype=np.uint8)  # 5 rows
    packed = pack_microbatch_routes([r0, r1], seq_len=6, num_experts=E)
    assert packed.shape == (2, 6, L, K) and packed.dtype == torch.int64
    assert packed[0, :3].tolist() == r0.tolist() and packed[1, :5].tolist() == r1.tolist()
    pads = torch.cat([packed[0, 3:].reshape(-1, K), packed[1, 5:].reshape(-1, K)])
    assert (pads[:, 0] != pads[:, 1]).all(), "pad rows must not repeat an expert"
    assert len(set(pads.flatten().tolist())) >= 6, "pad rows must spread over experts, not pile on one"


def test_pack_rejects_too_long_sample():
    with pytest.raises(ValueError, match="sample 0 has 7 route rows but the microbatch is only seq_len=6"):
        pack_microbatch_routes([np.zeros((7, 1, 2), np.uint8) + np.array([0, 1], np.uint8)], seq_len=6, num_experts=4)


def test_check_routes_names_duplicate_and_range():
    with pytest.raises(ValueError, match="repeats an expert"):
        check_routes(torch.tensor([[[1, 1]]]), 4)
    with pytest.raises(ValueError, match=r"must be in \[0, 4\)"):
        check_routes(torch.tensor([[[1, 4]]]), 4)


def test_sequence_parallel_shard_takes_contiguous_positions():
    B, S = 2, 4
    routes = torch.arange(B * S).view(B, S, 1, 1)
    per_layer = to_megatron_layout(routes)
    shard = sequence_parallel_shard(per_layer, B, tp_size=2, tp_rank=1)
    # rank 1 holds positions 2, 3 of both samples
    assert torch.equal(from_megatron_layout(shard, B), routes[:, 2:])


def test_context_parallel_shard_is_load_balanced():
    x = torch.arange(8).view(1, 8)
    assert context_parallel_shard(x, 2, 0).tolist() == [[0, 1, 6, 7]]
    assert context_parallel_shard(x, 2, 1).tolist() == [[2, 3, 4, 5]]
