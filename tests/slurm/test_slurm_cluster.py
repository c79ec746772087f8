"""Issue 39: the multi-node launch under a real SLURM cluster (scripts/slurm_local.sh: node1..node3 on this host).

Everything goes through the public commands: ``launch/slurm/submit.sh`` on a CPU twin as shipped (no
overrides; the job runs in a fresh directory, so its ``runs/<twin>`` is the test's), SLURM's own
``scontrol``/``scancel``, ``moe-rl train`` for the uninterrupted replay, and the run directory the job
writes. Two jobs per suite: the warned-and-requeued one (which also is the 3-node job that ends
COMPLETED) and the cancelled one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_rl.learner.dist import free_port
from moe_rl.train.metrics_log import read_metrics

REPO = Path(__file__).resolve().parents[2]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
pytestmark = [pytest.mark.slurm, pytest.mark.sglang, pytest.mark.distributed, pytest.mark.timeout(3600)]
TWIN = REPO / "configs" / "cpu" / "qwen3_30b_a3b.yaml"
RUN = Path("runs") / "qwen3_30b_a3b_cpu"
VOLATILE = ("time/", "rollout/tokens_per_s", "perf/", "records/other_run")  # wall clock; the replay reads our records


def _job_log(cwd: Path, job: str) -> str:
    path = cwd / f"moe_rl-{job}.out"
    return path.read_text(errors="replace") if path.exists() else "<no job output>"


def _learner_logs(cwd: Path, job: str) -> str:
    """The job's per-node logs, all runs of it (appended), one after the other."""
    return "".join(p.read_text(errors="replace") for p in sorted((cwd / RUN / "launch" / f"logs-{job}").glob("*")))


def _steady(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in metrics]


def _wait_for(predicate, what: str, cluster, job: str, cwd: Path, timeout_s: float = 1800, poll_s: float = 1.0) -> None:
    """Poll ``predicate`` while ``job`` runs; a job that ended first fails the test with its output."""
    deadline, looked = time.monotonic() + timeout_s, 0.0
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if time.monotonic() - looked > 5:
            looked = time.monotonic()
            info = cluster.job(job)
            assert info.get("JobState") not in ENDED, (
                f"job {job} ended ({info.get('JobState')}) before {what}:\n"
                + _job_log(cwd, job)[-3000:]
                + _learner_logs(cwd, job)[-3000:]
            )
        time.sleep(poll_s)


def _no_process_left(cluster, job: str) -> None:
    """Every process of ``job`` on every node is gone (slurmd's SIGKILL comes KillWait = 30 s after SIGTERM)."""
    deadline = time.monotonic() + 60
    while (left := cluster.job_processes(job)) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == [], f"job {job} left processes behind:\n" + "\n".join(left)


def _replay(records: Path, out: Path) -> list[dict]:
    """The uninterrupted run on the same records: ``moe-rl train`` on 2 ranks (torchrun) with ``train.rollouts_from``
    (sync: no server; the learner computes everything from the records)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "moe_rl.cli",
        "train",
        str(TWIN),
        f"train.output_dir={out}",
        f"train.rollouts_from={records}",
        "train.rollout_mode=sync",
        "logging.tensorboard=false",
        "logging.progress=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_metrics(out / "metrics.jsonl")


def test_warned_twin_job_on_three_nodes_checkpoints_requeues_itself_and_completes(slurm_cluster, tmp_path):
    """The 30B twin as shipped: one server on node1, learners on node2 + node3 (ep=2). SLURM's time-limit warning
    (``--signal=B:USR1@s``; sent here with ``scancel --batch --signal``, what SLURM does at the time limit) while
    step 1 runs: the learner finishes step 1, checkpoints, the job requeues itself, resumes at step 2 and ends
    COMPLETED; every step is logged once and equals an uninterrupted run on the same records."""
    job = slurm_cluster.submit(TWIN, tmp_path)
    records = tmp_path / RUN / "rollouts" / "step_000000.safetensors"
    with slurm_cluster.cancelled_on_failure(job):
        _wait_for(records.exists, "step 1's rollout records", slurm_cluster, job, tmp_path, poll_s=0.1)  # signal now
        slurm_cluster.signal_batch(job, "USR1")
        info = slurm_cluster.wait(job, timeout_s=3000)
    out, logs = _job_log(tmp_path, job), _learner_logs(tmp_path, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (
        out[-4000:] + logs[-6000:]
    )
    assert info["NodeList"] == "node[1-3]"
    assert "wrote runs/qwen3_30b_a3b_cpu/hf/initial" in out and "kept runs/qwen3_30b_a3b_cpu/hf/initial" in out
    assert out.count("moe_rl: http://node1:30000 healthy") == 2  # the job made the HF dir its server serves
    assert "got SIGUSR1 (launch.signal)" in out and f"requeueing job {job}" in out
    assert logs.count("moe_rl: stopped after step 1 of 2") == 2  # both ranks, after the same step
    run_logs = tmp_path / RUN / "launch" / f"logs-{job}"
    assert sorted(p.name for p in run_logs.iterdir()) == ["learner-node2.log", "learner-node3.log", "rollout-node1.log"]
    assert (tmp_path / RUN / "checkpoints" / "latest").read_text().strip() == "2"
    metrics = read_metrics(tmp_path / RUN / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]  # every step once
    assert all(
        m["train/grad_norm"] > 0 and m["replay/rollout_vs_dispatched/response/flip_rate"] == 0.0 for m in metrics
    )
    _no_process_left(slurm_cluster, job)
    replayed = _replay(tmp_path / RUN / "rollouts", tmp_path / "replay")
    assert _steady(metrics) == _steady(replayed)


def test_scancel_stops_every_step_and_leaves_no_process(slurm_cluster, tmp_path):
    job = slurm_cluster.submit(TWIN, tmp_path)
    logs = tmp_path / RUN / "launch" / f"logs-{job}"
    with slurm_cluster.cancelled_on_failure(job):
        _wait_for(
            lambda: all((logs / f"learner-{n}.log").exists() for n in ("node2", "node3")),
            "both learner nodes",
            slurm_cluster,
            job,
            tmp_path,
        )
        assert slurm_cluster.job_processes(job)  # the check below can see the job's processes
    subprocess.run(["scancel", job], check=True, timeout=30)
    info = slurm_cluster.wait(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0"
    _no_process_left(slurm_cluster, job)
