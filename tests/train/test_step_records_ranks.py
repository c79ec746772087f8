"""Issue 28 (from 25): with 2 ranks, every rank trains on the bytes rank 0 read, or all ranks fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed.torchrun import run_worker

WORKER = Path(__file__).with_name("step_records_worker.py")


def test_every_rank_verifies_rank_0s_digest(tmp_path):
    run_worker(WORKER, "--work", str(tmp_path), timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    fresh = {r["fresh"] for r in ranks}
    assert len(fresh) == 1 and fresh.pop().startswith("ok "), ranks  # one digest, both loaded
    for r in ranks:  # the stale copy on node 1 fails both ranks with rank 1's line
        assert r["stale"].startswith("train.rollouts_from=DIR: ") and "\n" not in r["stale"], r
        assert "node1/step_000000.safetensors: content has sha256" in r["stale"]
        assert "rank 1 does not see the file rank 0 read (a stale copy" in r["stale"]
        # rank 0's refusal reaches rank 1 too (no rank is left waiting in a collective)
        assert r["refused"].endswith("node0/step_000000.safetensors: records were made for 8 experts; "
                                     "model.num_moe_experts=16"), r  # fmt: skip
