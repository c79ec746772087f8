"""The local SLURM cluster (scripts/slurm_local.sh) as a session fixture, and the job helpers its tests share.

The fixture uses a cluster that already answers ``sinfo`` (``.ci/run`` brings one up), else brings one
up itself when it can (root, SLURM and munge installed) and takes it down at the end; otherwise every
test using it skips with the reason and the command that fixes it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UP = REPO / "scripts" / "slurm_local.sh"
NODES = ("node1", "node2", "node3")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
HOW = "run `sudo scripts/slurm_local.sh up` (Debian: installs slurm-wlm and munge), then `pytest -m slurm`"


def _idle_nodes() -> set[str]:
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {line.split()[0] for line in out.stdout.splitlines() if line.split()[1:] == ["idle"]}


@dataclass
class SlurmCluster:
    """Submit moe_rl jobs to the local cluster and watch them through SLURM's own commands."""

    def job_env(self) -> dict[str, str]:
        """The submitting environment (sbatch exports it to the job): this interpreter's venv and this checkout."""
        venv = Path(sys.executable).parent.parent
        return {
            **os.environ,
            "MOE_RL_VENV": str(venv),
            "MOE_RL_PYTHON": sys.executable,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            "PATH": os.pathsep.join([str(venv / "bin"), os.environ["PATH"]]),
        }

    def submit(self, config: Path, cwd: Path, *overrides: str) -> str:
        """``launch/slurm/submit.sh CONFIG [overrides]`` from ``cwd``; the job id."""
        proc = subprocess.run(
            [str(REPO / "launch/slurm/submit.sh"), str(config), *overrides],
            cwd=cwd,
            env=self.job_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        m = re.search(r"Submitted batch job (\d+)", proc.stdout)
        assert m, proc.stdout
        return m.group(1)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``'s fields (JobState, ExitCode, Restarts, Reason, ...)."""
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30, check=False
        )
        return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)

    def wait(self, job_id: str, until=lambda info: info.get("JobState") in ENDED, timeout_s: float = 1800) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if until(info):
                return info
            time.sleep(2)
        subprocess.run(["scancel", job_id], timeout=30, check=False)
        raise AssertionError(f"job {job_id} not done within {timeout_s} s: {self.job(job_id)}")

    @contextlib.contextmanager
    def cancelled_on_failure(self, job_id: str) -> Iterator[None]:
        """A failed check inside the block cancels the job (no test leaves a job running)."""
        try:
            yield
        except BaseException:
            subprocess.run(["scancel", job_id], timeout=30, check=False)
            raise

    def signal_batch(self, job_id: str, sig: str) -> None:
        """What ``#SBATCH --signal=B:<sig>@<s>`` does at <s> seconds before the time limit."""
        subprocess.run(["scancel", "--batch", f"--signal={sig}", job_id], check=True, timeout=30)

    @staticmethod
    def job_processes(job_id: str) -> list[str]:
        """``pid cmdline`` of every process on this host (all three nodes) that belongs to job ``job_id``."""
        found = []
        for env_file in Path("/proc").glob("[0-9]*/environ"):
            try:
                environ = env_file.read_bytes().split(b"\0")
                cmd = (env_file.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"SLURM_JOB_ID={job_id}".encode() in environ or f"SLURM_JOBID={job_id}".encode() in environ:
                found.append(f"{env_file.parent.name} {cmd[:200]}")
        return found


@pytest.fixture(scope="session")
def slurm_cluster():
    if shutil.which("sbatch") is None and os.geteuid() != 0:
        pytest.skip(f"SLURM is not installed; {HOW}")
    started = False
    if not set(NODES) <= _idle_nodes():
        if os.geteuid() != 0:
            pytest.skip(f"no local SLURM cluster answers sinfo and starting one needs root; {HOW}")
        proc = subprocess.run(["bash", str(UP), "up"], capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0:
            pytest.skip(f"scripts/slurm_local.sh up failed here: {(proc.stderr or proc.stdout).strip()[-500:]}")
        started = True
    if not set(NODES) <= _idle_nodes():
        pytest.skip(f"the SLURM cluster here has no idle {', '.join(NODES)}; {HOW}")
    yield SlurmCluster()
    if started:
        subprocess.run(["bash", str(UP), "down"], capture_output=True, timeout=120, check=False)
