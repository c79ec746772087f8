"""A real ``Learner`` under pipeline parallelism (pp=2, two processes, Megatron's 1F1B schedule).

The worker (``pp_worker.py``, ~30 s on an idle machine) checks routing replay per stage (R2 records and
replays each stage's own MoE layers; a router left out of stage 1's binding shows as flips on that layer
only, logged identically by both stages), the expert-bias update of every stage's routers, and the HF
export from a pp=2 layout (equal to pp=1's). The end-to-end pp=2 == 1 rank equality is in ``test_step_equality.py``; the last test resumes a pp=2
checkpoint at pp=1 through the CLI.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.learner.dist import free_port
from moe_rl.learner.sharded_state import ShardedDir
from moe_rl.train.metrics_log import read_metrics
from tests.conftest import one_gpu_per_rank
from tests.learner.hf_import_check import bytes_problems, uncovered
from tests.train.records_fixture import initial_hf_dir
from tests.train.test_step_equality import assert_same_steps, run

pytestmark = [pytest.mark.distributed, one_gpu_per_rank(2)]

WORKER = Path(__file__).with_name("pp_worker.py")


@pytest.fixture(scope="module")
def worker_output(tmp_path_factory):
    torchrun = Path(sys.executable).with_name("torchrun")
    hf_dir = tmp_path_factory.mktemp("pp_worker") / "hf"
    cmd = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", str(WORKER), str(hf_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    reports = [hf_dir.parent / f"hf_import_pp2_rank{r}.json" for r in range(2)]
    return proc.returncode, proc.stdout, proc.stderr[-4000:], [p.read_text() if p.exists() else None for p in reports]


@pytest.mark.parametrize("check", ["r2", "unbound"])
def test_replay_binds_each_stage_to_its_own_moe_layers(worker_output, check):
    rc, out, err, _ = worker_output
    assert f"rank 0 {check}: OK" in out and f"rank 1 {check}: OK" in out, f"rc={rc}\n{out[-3000:]}\n{err}"


def test_each_stage_updates_its_routers_expert_bias_from_its_own_token_counts(worker_output):
    rc, out, err, _ = worker_output
    assert "rank 0 expert_bias: OK" in out and "rank 1 expert_bias: OK" in out, f"rc={rc}\n{out[-3000:]}\n{err}"


def test_hf_export_from_two_stages_equals_one_stage(worker_output):
    rc, out, err, _ = worker_output
    assert rc == 0 and "rank 0 export: OK" in out, f"rc={rc}\n{out[-3000:]}\n{err}"


def test_each_stage_imports_only_its_layers_from_hf_equal_to_the_whole_dict_import(worker_output):
    """Issue 52: at pp=2 each stage reads only its own layers (plus embedding / output layer) by the reader's
    byte counter, equal bitwise to the former whole-dict import; the two stages together read every byte."""
    rc, out, err, raw = worker_output
    assert None not in raw, f"rc={rc}\n{out[-3000:]}\n{err}"
    reports = [json.loads(r) for r in raw]
    assert all(r["bitwise_equal"] for r in reports), "per-stage import differs from the whole-dict import"
    assert not bytes_problems(reports), bytes_problems(reports)
    assert not uncovered(reports), f"no stage read {uncovered(reports)[:3]}"
    assert all(r["bytes_read"] < 0.75 * r["checkpoint_bytes"] for r in reports), [r["bytes_read"] for r in reports]


def test_a_pp2_checkpoint_holds_every_stage_and_resumes_at_pp1(tmp_path):
    """The layout-free checkpoint of a pp=2 run (2 ranks, every step saved) carries both stages' layers
    under global numbers; the job "dies" after step 1 and the same command resumes at pp=1 on 1 rank:
    step 2 equals the uninterrupted pp=2 step 2 (the equality tests' tolerance)."""

    hf = initial_hf_dir(tmp_path / "hf")
    out, common = tmp_path / "run", ("loss.kl_coef=0.01", "checkpoint.save_interval=1", "train.micro_batch_size=2")
    uninterrupted = run(out, hf, *common, "parallel.pp=2", nproc=2)
    ckpt = out / "checkpoints"
    names = ShardedDir(ckpt / "step_00000001", "model").keys  # both stages' rank files, global layer numbers
    assert {
        "embedding.word_embeddings.weight",
        "output_layer.weight",
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.1.mlp.router.weight",
    } <= names, sorted(names)[:8]
    shutil.rmtree(ckpt / "step_00000002")
    (ckpt / "latest").write_text("1\n")
    run(out, hf, *common, "parallel.pp=1", nproc=1)
    assert_same_steps(uninterrupted, read_metrics(out / "metrics.jsonl"), "pp=2 -> pp=1 resume")
