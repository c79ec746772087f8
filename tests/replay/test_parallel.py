"""Replay under expert parallel (ep=2) and pipeline parallel (pp=2): two real processes (torchrun; gloo on
CPU, nccl with one GPU per rank)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.learner.dist import free_port
from tests.conftest import one_gpu_per_rank

pytestmark = [pytest.mark.distributed, one_gpu_per_rank(2)]

WORKER = Path(__file__).with_name("parallel_worker.py")


@pytest.fixture(scope="module")
def torchrun_output():
    """Run the 2-rank worker once (< 1 min) and hand its stdout to the tests below."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", str(WORKER)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_replay_under_ep2_dispatches_each_ranks_given_routes(torchrun_output, dispatcher):
    rc, out, err = torchrun_output
    for rank in (0, 1):
        assert f"rank {rank} {dispatcher}: OK" in out, f"torchrun rc={rc}\n{out[-3000:]}\n{err[-3000:]}"


def test_pipeline_stages_take_their_own_moe_layers_from_whole_model_routes(torchrun_output):
    rc, out, err = torchrun_output
    ok = rc == 0 and "rank 0 pp: OK" in out and "rank 1 pp: OK" in out
    assert ok, f"torchrun rc={rc}\n{out[-3000:]}\n{err[-3000:]}"
