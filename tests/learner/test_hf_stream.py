"""The streaming HF export and weight-sync stream at 2 ranks (ep=2, pp=2) give back the checkpoint the learner
was loaded from, bit for bit, with no tensor sent twice and no bucket over its size (torchrun, gloo).

Break tried: gathering experts to ep rank 0 with ids ``e * ep + r`` instead of ``r * num_local + e`` fails
the ep=2 equality (72 expert tensors differ).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.learner.hf_convert import read_hf_state_dict
from tests.conftest import one_gpu_per_rank
from tests.distributed.torchrun import run_worker

WORKER = Path(__file__).with_name("hf_stream_worker.py")


@pytest.mark.distributed
@one_gpu_per_rank(2)
def test_streamed_export_and_sync_stream_equal_the_initial_checkpoint_at_ep2_and_pp2(tmp_path):
    run_worker(WORKER, str(tmp_path), timeout=240)
    want = read_hf_state_dict(tmp_path / "init")
    report = json.loads((tmp_path / "report.json").read_text())
    for layout in ("ep2", "pp2"):
        index = json.loads((tmp_path / layout / "model.safetensors.index.json").read_text())
        files = set(index["weight_map"].values())
        assert {f.split("-")[1] for f in files} == {"r00000", "r00001"}, f"{layout}: both ranks write their shards"
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
        for got in (read_hf_state_dict(tmp_path / layout), load_file(tmp_path / f"{layout}_stream.safetensors")):
            assert set(got) == set(want), f"{layout}: names differ: {sorted(set(got) ^ set(want))[:4]}"
            bad = [n for n in want if not torch.equal(got[n], want[n])]
            assert not bad, f"{layout}: {len(bad)} tensors differ, e.g. {bad[:3]}"
        assert report[layout]["max_multi_bucket"] <= 24 << 10, "a bucket of several tensors exceeds its size"
    assert report["ep2"]["senders"] == [True, False], "experts are gathered to one source (ep=2, one stage)"
    assert report["pp2"]["senders"] == [True, True], "one source per pipeline stage"
