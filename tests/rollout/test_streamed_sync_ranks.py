"""The streaming export and weight sync at 2 learner ranks (ep=2 and pp=2), against a real SGLang CPU server.

Oracles, independent of the code under test: the learner was loaded from a random HF checkpoint (v2), so
* the HF export (every owner writing its shards) and the sync stream (one source per stage, experts gathered)
  must give back exactly that checkpoint, every name and every bit, no tensor twice, no bucket over its size;
* every transport (tensor, distributed, disk) must make the server serve what SGLang's own loader serves
  from the v2 directory (today's disk sync of the file): the same tokens, log-probs and routes.

Breaks tried: expert ids gathered as ``e * ep + r`` fail the export equality (72 tensors differ); a disk
sync whose index lists rank 0's files only fails the served equality (SGLang keeps rank 1's tensors old);
each expert tensor gathered whole from every ep rank before it is bucketed (``dist.gather`` per tensor, as
before issue 52) fails the held-bytes bound (the open bucket plus ep copies of the tensor).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from moe_rl.config import ModelConfig
from moe_rl.learner.dist import free_port
from moe_rl.learner.hf_convert import read_hf_state_dict
from moe_rl.sync.transport import update_weights_from_disk
from tests.conftest import one_gpu_per_rank, repo_env, run_to_file
from tests.rollout import sync_ranks_worker as worker

pytestmark = [pytest.mark.sglang, pytest.mark.distributed]
LAYOUTS, MODES = ("ep2", "pp2"), ("tensor", "distributed", "disk")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def synced(sglang_server, route_spec, rollout_model_cfg, model_dir, model_dir_v2, tmp_path_factory):
    """The worker's outputs (against the session's server), and what the server serves after loading v1 and v2
    from disk itself."""
    assert rollout_model_cfg.model_dump() == ModelConfig(**worker.MODEL).model_dump(), "the worker's model differs"
    root, url = tmp_path_factory.mktemp("sync_ranks"), sglang_server.url
    try:
        update_weights_from_disk([url], model_dir_v2, "disk-v2")
        oracle = worker.generate(url, worker.config(str(model_dir_v2)))
        update_weights_from_disk([url], model_dir, "v1")
        before = worker.generate(url, worker.config(str(model_dir_v2)))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            worker.__file__,
            url,
            str(model_dir),
            str(model_dir_v2),
            str(root),
        ]
        # to a file: the ranks' torch_shm_manager outlives them while the server maps the synced tensors
        proc, out = run_to_file(cmd, root / "worker.txt", env=repo_env(REPO, OMP_NUM_THREADS="1"), timeout=480)
        assert proc.returncode == 0, f"the 2-rank worker failed:\n{out[-4000:]}"
    finally:
        update_weights_from_disk([url], model_dir, "v1")
    return root, oracle, before, Path(model_dir_v2)


@one_gpu_per_rank(2)
def test_every_transport_at_two_ranks_serves_what_the_servers_own_loader_serves(synced):
    root, oracle, before, _ = synced
    assert any(not np.array_equal(oracle[f"logp{i}"], before[f"logp{i}"]) for i in range(2)), "v1 == v2?"
    for layout in LAYOUTS:
        for mode in MODES:
            got = np.load(root / f"{layout}-{mode}.npz")
            assert list(got["versions"]) == [f"{layout}-{mode}"] * 2
            for i in range(2):
                np.testing.assert_array_equal(got[f"ids{i}"], oracle[f"ids{i}"], err_msg=f"{layout} {mode}")
                assert got[f"logp{i}"].tobytes() == oracle[f"logp{i}"].tobytes(), f"{layout} {mode}: log-probs differ"
                np.testing.assert_array_equal(got[f"routes{i}"], oracle[f"routes{i}"], err_msg=f"{layout} {mode}")


@one_gpu_per_rank(2)
def test_the_streamed_export_and_sync_stream_give_back_the_checkpoint_bit_for_bit(synced):
    root, want = synced[0], read_hf_state_dict(synced[3])
    report = json.loads((root / "report.json").read_text())
    for layout in LAYOUTS:
        index = json.loads((root / layout / "model.safetensors.index.json").read_text())
        files = set(index["weight_map"].values())
        assert {f.split("-")[1] for f in files} == {"r00000", "r00001"}, f"{layout}: both ranks write their shards"
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
        for got in (read_hf_state_dict(root / layout), load_file(root / f"{layout}_stream.safetensors")):
            assert set(got) == set(want), f"{layout}: names differ: {sorted(set(got) ^ set(want))[:4]}"
            bad = [n for n in want if not torch.equal(got[n], want[n])]
            assert not bad, f"{layout}: {len(bad)} tensors differ, e.g. {bad[:3]}"
        assert report[layout]["max_multi_bucket"] <= worker.BUCKET, "a bucket of several tensors exceeds its size"
        assert 2 * report[layout]["largest_expert"] <= worker.BUCKET, "experts of both ep ranks fit in a bucket"
        assert 0 < report[layout]["peak_bytes"] <= worker.BUCKET, (
            f"{layout}: a rank held {report[layout]['peak_bytes']} bytes for the stream at once "
            f"(rollout.weight_sync_bucket_mb: {worker.BUCKET}): experts must be gathered per bucket, not per tensor"
        )
    assert report["ep2"]["senders"] == [True, False], "experts are gathered to one source (ep=2, one stage)"
    assert report["pp2"]["senders"] == [True, True], "one source per pipeline stage"
    # each stage's source advertised its own address and the server joined there (plumbing only: both loopback)
    assert report["pp2"]["group_addresses"] == worker.STAGE_ADDRESSES
    assert report["ep2"]["group_addresses"] == [worker.STAGE_ADDRESSES[0], None]


@one_gpu_per_rank(2)
def test_a_nan_on_one_rank_sends_nothing_and_stops_every_rank_with_one_message(synced):
    report = json.loads((synced[0] / "report.json").read_text())["pp2"]
    first, second = report["nan_errors"]
    assert first == second and first is not None, report["nan_errors"]
    assert "(rank 1) holds NaN or Inf values; nothing was sent" in first and "decoder.layers.2." in first, (
        first
    )  # stage 1: layers 2, 3
    assert report["after_nan"] == "v1", "the server must keep serving its previous weights"
