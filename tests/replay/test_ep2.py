"""Replay under expert parallel size 2: two real processes (torchrun, gloo)."""

import os
import subprocess
import sys
from pathlib import Path

from moe_rl.learner.dist import free_port

WORKER = Path(__file__).with_name("ep2_worker.py")


def test_replay_under_ep2_dispatches_each_ranks_given_routes():
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", str(WORKER)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for rank in (0, 1):
        for dispatcher in ("allgather", "alltoall"):
            assert f"rank {rank} {dispatcher}: OK" in proc.stdout, proc.stdout[-3000:]
