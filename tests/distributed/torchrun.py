"""Run a 2-rank torchrun worker script from the repository root (gloo), retrying once on a taken port."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.learner.dist import free_port
from tests.conftest import repo_env

REPO = Path(__file__).resolve().parents[2]


def run_worker(worker: Path, *args: str, timeout: float = 240, nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc worker *args``; fails the test with the stderr tail unless rc == 0."""

    env = repo_env(REPO, OMP_NUM_THREADS="1")
    for attempt in range(2):  # a free port can be taken between probe and bind: retry once
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
            str(worker),
            *args,
        ]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode == 0:
            return proc
        if attempt == 1 or "address already in use" not in proc.stderr.lower():
            pytest.fail(f"torchrun worker failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    raise AssertionError("unreachable")
