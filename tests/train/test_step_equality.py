"""The same step whatever the grouping: 2 ranks (dp=2, ep=2, pp=2) == 1 rank, micro_batch_size 1 / 2 / whole.

Every run trains 2 steps on the same saved SGLang records (``train.rollouts_from``, no server) from
the same initial weights (``checkpoint.init_from_hf``), through the CLI as a user runs it (torchrun
for 2 ranks, gloo). Responses have different lengths (up to 16 tokens), the minibatch of 8 is cut
into several microbatches, 2 minibatches per step. Per step the loss, gradient norm and every
logged metric must agree.

Tolerance: fp32 learner, relative 1e-5 or absolute 2e-6. Every statistic is computed on the whole
minibatch gathered from all ranks, so the only differences are float summation orders: gradients
summed over microbatches vs all-reduced over ranks, and matmuls over differently padded
microbatches, which move a log-prob of magnitude ~4 by an ulp (~5e-7). Log-ratios, KL, χ² and
the loss are differences of log-probs, so their noise is absolute. The router aux loss (a per-microbatch mean in Megatron) is off
in tiny_cpu (``moe_aux_loss_coeff: 0``), the one documented exception to microbatch invariance.
"""

from __future__ import annotations

import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from moe_rl.learner.dist import free_port
from moe_rl.records import RolloutBatch
from moe_rl.train.metrics_log import read_metrics
from tests.conftest import one_gpu_per_rank, repo_env
from tests.train.records_fixture import CONFIG, RECORDS, SHAPE, initial_hf_dir

pytestmark = pytest.mark.distributed
# fp32 log-probs near |log p| ~ 4 carry ~5e-7 absolute rounding; log-ratios, KL, χ² and the loss are
# differences of such numbers, so their noise is absolute, not relative.
REL, ABS = 1e-5, 2e-6
VOLATILE = ("time/", "rollout/tokens_per_s", "records/read_bytes_max")  # the last: per rank, checked below


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return initial_hf_dir(tmp_path_factory.mktemp("initial_hf"))


def run(out, hf_dir, *overrides, nproc=1):
    args = [
        "-m",
        "moe_rl.cli",
        "train",
        str(CONFIG),
        *SHAPE,
        "train.steps=2",
        f"train.rollouts_from={RECORDS}",
        f"checkpoint.init_from_hf={hf_dir}",
        f"train.output_dir={out}",
        *overrides,
    ]
    if nproc > 1:
        launcher = [
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
        ]
        args = launcher + args
    # one thread, as torchrun gives each of its ranks: two 1-rank runs share the machine's 2 cores
    proc = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=repo_env(Path(__file__).parents[2], OMP_NUM_THREADS="1"),
        check=False,
    )
    assert proc.returncode == 0, f"run {overrides} x{nproc} failed:\n{proc.stderr[-4000:]}"
    return read_metrics(out / "metrics.jsonl")


def assert_same_steps(expected, got, what):
    assert [m["step"] for m in got] == [m["step"] for m in expected] == [1, 2], what
    for a, b in zip(expected, got):
        keys = {k for k in a if not k.startswith(VOLATILE)}
        assert keys == {k for k in b if not k.startswith(VOLATILE)}, f"{what}: different metric names"
        bad = {
            k: (a[k], b[k])
            for k in sorted(keys)
            if isinstance(a[k], float) and not math.isclose(a[k], b[k], rel_tol=REL, abs_tol=ABS)
        }
        assert not bad, f"{what}, step {a['step']}: {bad}"


# The 1-rank runs: the baselines (micro_batch_size 2) and the microbatch variants of the R3 run.
ONE_RANK = {
    "r3": ("replay.routing=r3", "train.micro_batch_size=2"),
    "r2": ("replay.routing=r2", "train.micro_batch_size=2"),
    "r3_micro1": ("replay.routing=r3", "train.micro_batch_size=1"),
    "r3_micro_whole": ("replay.routing=r3", "train.micro_batch_size=8"),  # the whole minibatch in one microbatch
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, hf_dir):
    """Every 1-rank run's metrics, two runs at a time (each is one process on one thread; the machine has 2 cores)."""
    with ThreadPoolExecutor(2) as pool:
        futures = {k: pool.submit(run, tmp_path_factory.mktemp(k), hf_dir, *o) for k, o in ONE_RANK.items()}
    return {k: f.result() for k, f in futures.items()}


def test_records_have_ragged_responses_and_several_microbatches():
    batch = RolloutBatch.load(RECORDS / "step_000000.safetensors")
    assert len(set(batch.response_lens.tolist())) > 1 and len(batch) == 16


@pytest.mark.parametrize(
    "layout",
    [
        ("train.micro_batch_size=2",),  # dp=2 (each rank: 4 of each minibatch's 8, 2 microbatches)
        ("train.micro_batch_size=2", "parallel.ep=2"),  # ep=2 over the same 2 data-parallel ranks
        ("train.micro_batch_size=2", "parallel.pp=2"),  # pp=2: one layer per stage, Megatron's 1F1B schedule
        "r3_micro1",
        "r3_micro_whole",
    ],
    ids=["dp2", "ep2", "pp2", "micro1", "micro_whole"],
)
@one_gpu_per_rank(2)
def test_decoupled_r3_ksm_step_is_independent_of_ranks_and_microbatches(tmp_path, hf_dir, one_rank, layout):
    got = one_rank[layout] if isinstance(layout, str) else run(tmp_path, hf_dir, "replay.routing=r3", *layout, nproc=2)
    assert_same_steps(one_rank["r3"], got, f"{layout}")
    assert all(m["replay/rollout_vs_dispatched/response/flip_rate"] == 0.0 for m in got)
    if layout in {("train.micro_batch_size=2",), ("train.micro_batch_size=2", "parallel.ep=2")}:  # dp=2
        # each rank reads its share of the step's records (issue 52 item 4), by the reader's own byte counter
        assert all(m["records/read_bytes_max"] <= 0.6 * m["records/file_bytes"] for m in got), got


@one_gpu_per_rank(2)
@pytest.mark.parametrize("layout", [(), ("parallel.ep=2",)], ids=["dp2", "ep2"])
def test_decoupled_r2_step_on_two_ranks_equals_one_rank(tmp_path, hf_dir, one_rank, layout):
    two = run(tmp_path, hf_dir, "replay.routing=r2", "train.micro_batch_size=2", *layout, nproc=2)
    assert_same_steps(one_rank["r2"], two, f"r2 {layout or 'dp=2'}")
    assert all(m["records/read_bytes_max"] <= 0.6 * m["records/file_bytes"] for m in two), two
    assert all(m["replay/r2_vs_dispatched/response/flip_rate"] == 0.0 for m in two)
