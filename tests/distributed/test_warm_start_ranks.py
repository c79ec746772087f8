"""The warm-start cache hit is one decision for all ranks (rank 0 decides, broadcasts), also with a
node-local ``train.warm_start.cache_dir`` that holds the cache on one node only (2 ranks, torchrun, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import one_gpu_per_rank
from tests.distributed.torchrun import run_worker

WORKER = Path(__file__).with_name("warm_start_worker.py")


@pytest.mark.distributed
@one_gpu_per_rank(2)
def test_a_cache_present_on_one_node_only_makes_every_rank_train(tmp_path):
    out = tmp_path / "result.json"
    run_worker(WORKER, "--root", str(tmp_path), "--out", str(out), timeout=240)  # a split decision hangs
    reports = json.loads(out.read_text())
    for r in reports:
        # shared dir: trained once; node-local dirs with the cache on node 0 only: trained again on both;
        # then every node's cache is complete (its shard + meta.json): loaded on both
        assert r["passes"] == [False, False, True], r
    assert reports[0]["files"] == ["meta.json", "rank_00000.safetensors", "rank_00001.safetensors"]
    assert reports[1]["files"] == ["meta.json", "rank_00001.safetensors"]
