"""Issue 21 item 5: ``replay/rollout_vs_dispatched/*`` under sequence parallel (tp > 1).

The full model cannot run tp > 1 on CPU (MoE with tp > 1 needs Transformer Engine), so the
comparison itself runs over gloo on 2 ranks with Megatron's tensor-parallel group: each rank compares
its block of positions, and the counts sum to every token of the microbatch. A layer whose dispatched
map differs on one rank is the only layer that reports flips.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_rl.replay.layout import sequence_parallel_positions, sequence_parallel_shard, to_megatron_layout
from tests.distributed.torchrun import run_worker
from tests.replay.sp_flips_worker import inputs

WORKER = Path(__file__).with_name("sp_flips_worker.py")
NAME = "replay/rollout_vs_dispatched"


def test_positions_are_the_blocks_the_binding_replays():
    routes, _, _ = inputs()
    for rank in range(2):
        torch.testing.assert_close(
            to_megatron_layout(sequence_parallel_positions(routes, 2, rank)),
            sequence_parallel_shard(to_megatron_layout(routes), routes.shape[0], 2, rank),
        )


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "summary.json"
    run_worker(WORKER, "--out", str(out))
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("flip", [False, True])
def test_sequence_parallel_flips_are_counted_over_every_block(summaries, flip, device):
    got = summaries["flip" if flip else "clean"]
    _, valid, response = inputs()
    n_resp, n_prompt = int(response.sum()), int((valid & ~response).sum())
    assert got[f"{NAME}/response/tokens"] == n_resp and got[f"{NAME}/prompt/tokens"] == n_prompt  # both blocks
    # positions 4 and 5 (rank 1's first two) of each sample, where valid
    flipped = torch.zeros_like(valid)
    flipped[:, 4:6] = True
    for part, where in (("response", response), ("prompt", valid & ~response)):
        n = int((flipped & where).sum()) if flip else 0
        assert got[f"{NAME}/{part}/flip_rate/layer1"] == pytest.approx(n / int(where.sum()))
        assert got[f"{NAME}/{part}/flip_rate/layer0"] == 0 and got[f"{NAME}/{part}/flip_rate/layer2"] == 0
    assert not flip or got[f"{NAME}/response/flip_rate/layer1"] > 0
