"""Tensor parallelism over gloo (torchrun, 2 ranks): Keep Sampling Mask and Σ_v π_v² on vocab-sharded logits and
HF-export gathering of hand-sharded tp/etp state dicts, each against the unsharded reference.

The worker runs on CPU tensors by design (gloo; two ranks cannot share one GPU under NCCL).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.torchrun import run_worker

WORKER = Path(__file__).with_name("tp_shards_worker.py")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "result.json"
    run_worker(WORKER, "--out", str(out), timeout=180)
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_keep_mask_on_vocab_shards_equals_unsharded(reports):
    for rank, r in enumerate(reports):
        ksm = r["ksm"]
        assert ksm["logp_max_diff"] < 1e-12, (rank, ksm)
        assert ksm["outside_equal"] and ksm["num_outside"] >= 1, (rank, ksm)
        assert ksm["max_abs_grad"] > 0.1 and ksm["grad_max_diff"] < 1e-12, (rank, ksm)


@pytest.mark.distributed
def test_sum_pi_squared_on_vocab_shards_equals_unsharded(reports):
    """The optimal token baselines' Σ_v π_v² (issue 54): all-reduced over tp it is the full softmax's."""
    for rank, r in enumerate(reports):
        spp = r["spp"]
        assert spp["max_rel_diff"] < 1e-12 and 0 < spp["min"] < spp["max"] <= 1, (rank, spp)


@pytest.mark.distributed
def test_kept_set_sum_pi_squared_on_vocab_shards_equals_the_kept_softmax(reports):
    """Keep Sampling Mask's Σ_{v∈K} π_v² (the token baselines' input under tiny_cpu's KSM): rows spanning both
    shards, one inside a shard, untruncated rows; each rank's half summed over tp is the kept-set softmax's."""
    for rank, r in enumerate(reports):
        ksm = r["ksm"]
        lo, hi = ksm["kept_spp_range"]
        assert ksm["kept_spp_max_rel_diff"] < 1e-12 and 0 < lo < hi <= 1, (rank, ksm)


@pytest.mark.distributed
def test_tp_shards_gather_to_the_full_state_and_slice_back(reports):
    for rank, r in enumerate(reports):
        g = r["gather"]
        assert g["names_equal"] and g["num_tensors"] == 15, (rank, g)
        assert g["gather_mismatched"] == [] and g["slice_mismatched"] == [], (rank, g)
