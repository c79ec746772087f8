"""Issue 39: the multi-node launch under a real SLURM cluster (scripts/slurm_local.sh: node1..node3 on this host).

Everything goes through the public commands: ``launch/slurm/submit.sh`` on a CPU twin as shipped (no
overrides; the job runs in a fresh directory, so its ``runs/<twin>`` is the test's), SLURM's own
``scontrol``/``scancel``, and the run directory the job writes. Each test runs its job once per suite.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import REPO

from moe_rl.train.metrics_log import read_metrics

pytestmark = [pytest.mark.slurm, pytest.mark.sglang, pytest.mark.distributed, pytest.mark.timeout(1500)]
TWIN = REPO / "configs" / "cpu" / "qwen3_30b_a3b.yaml"
RUN = Path("runs") / "qwen3_30b_a3b_cpu"
VOLATILE = ("time/", "rollout/tokens_per_s", "perf/")  # wall-clock figures differ between any two runs


def _job_log(cwd: Path, job: str) -> str:
    path = cwd / f"moe_rl-{job}.out"
    return path.read_text(errors="replace") if path.exists() else "<no job output>"


def _learner_logs(cwd: Path, job: str) -> str:
    return "".join(p.read_text(errors="replace")[-3000:] for p in sorted((cwd / RUN / "launch" / f"logs-{job}").glob("*")))


def _steady(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in metrics]


def _wait_for(predicate, what: str, timeout_s: float = 900, poll_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def _no_process_left(cluster, job: str) -> None:
    """Every process of ``job`` on every node is gone (slurmd's SIGKILL comes KillWait = 30 s after SIGTERM)."""
    deadline = time.monotonic() + 60
    while (left := cluster.job_processes(job)) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == [], f"job {job} left processes behind:\n" + "\n".join(left)


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory):
    """The twin submitted as shipped and run to the end: ``(cwd, job id, scontrol fields)``."""
    cwd = tmp_path_factory.mktemp("slurm_twin")
    job = slurm_cluster.submit(TWIN, cwd)
    return cwd, job, slurm_cluster.wait(job)


def test_twin_job_trains_on_three_nodes_and_completes(slurm_cluster, uninterrupted):
    cwd, job, info = uninterrupted
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _job_log(cwd, job)[-4000:] + _learner_logs(cwd, job)
    assert info["NodeList"] == "node[1-3]" and info["Restarts"] == "0"
    out = _job_log(cwd, job)
    assert "wrote runs/qwen3_30b_a3b_cpu/hf/initial" in out  # the job made the HF dir its server serves
    assert "moe_rl: http://node1:30000 healthy" in out
    logs = cwd / RUN / "launch" / f"logs-{job}"
    assert sorted(p.name for p in logs.iterdir()) == ["learner-node2.log", "learner-node3.log", "rollout-node1.log"]
    assert all((logs / f"learner-{n}.log").stat().st_size > 0 for n in ("node2", "node3"))
    metrics = read_metrics(cwd / RUN / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["train/grad_norm"] > 0 and m["replay/rollout_vs_dispatched/response/flip_rate"] == 0.0 for m in metrics)
    assert (cwd / RUN / "checkpoints" / "latest").read_text().strip() == "2"
    _no_process_left(slurm_cluster, job)


def test_warned_job_checkpoints_requeues_itself_and_matches_the_uninterrupted_run(slurm_cluster, uninterrupted, tmp_path):
    """SLURM's time-limit warning (``--signal=B:USR1@s``, sent here with ``scancel --batch --signal``) while step 1
    runs: the learner finishes it, checkpoints, the job requeues itself and finishes step 2 after the restart."""
    job = slurm_cluster.submit(TWIN, tmp_path)
    # step 1 is in progress once its rollout records exist (written before it trains on them)
    records = tmp_path / RUN / "rollouts" / "step_000000.safetensors"
    _wait_for(records.exists, "step 1's rollout records", poll_s=0.1)  # its training takes seconds: signal now
    slurm_cluster.signal_batch(job, "USR1")
    info = slurm_cluster.wait(job)
    out, logs = _job_log(tmp_path, job), _learner_logs(tmp_path, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-4000:] + logs
    assert "got SIGUSR1 (launch.signal)" in out and f"requeueing job {job}" in out
    assert "moe_rl: stopped after step 1 of 2" in logs
    metrics = read_metrics(tmp_path / RUN / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]  # every step once
    assert _steady(metrics) == _steady(read_metrics(uninterrupted[0] / RUN / "metrics.jsonl"))
    _no_process_left(slurm_cluster, job)


def test_scancel_stops_every_step_and_leaves_no_process(slurm_cluster, tmp_path):
    job = slurm_cluster.submit(TWIN, tmp_path)
    logs = tmp_path / RUN / "launch" / f"logs-{job}"
    _wait_for(lambda: all((logs / f"learner-{n}.log").exists() for n in ("node2", "node3")), "both learner nodes")
    assert slurm_cluster.job_processes(job)  # the check below can see the job's processes
    import subprocess

    subprocess.run(["scancel", job], check=True, timeout=30)
    info = slurm_cluster.wait(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0"
    _no_process_left(slurm_cluster, job)
