"""Issue 57, item 4: a supervised rollout process, through ``moe-rl train`` on the session's tiny_cpu server.

kill -9 of the async rollout process alone (what an OOM kill does) is reported in one line naming its pid and
signal, and the trainer starts another from the last handed-over step: every step is trained once, on records
made for it within the staleness bound, with no traceback. Past ``rollout.max_process_restarts`` the run stops
with that one line (exit code 2) and leaves no process behind.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from moe_rl.records import RolloutBatch
from moe_rl.rollout.orphan_guard import group_pids
from moe_rl.train.metrics_log import read_metrics
from tests.train.test_trainer_e2e import _console, train_cmd

pytestmark = pytest.mark.sglang

ARGS = (
    "train.rollout_mode=async",
    "train.max_staleness=1",
    "train.steps=3",
    "checkpoint.save_interval=0",
    "replay.routing=r3",
)


def _rollout_process(trainer: int, timeout_s: float = 120) -> int:
    """The pid of the trainer's rollout process (its one child started by multiprocessing's spawn)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = set()
        for task in Path(f"/proc/{trainer}/task").glob("*"):
            try:
                kids |= {int(p) for p in (task / "children").read_text().split()}
            except OSError:
                continue
        spawned = []
        for pid in kids:
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    spawned.append(pid)
            except OSError:
                continue
        assert len(spawned) <= 1, f"several spawned children of the trainer: {spawned}"
        if spawned:
            return spawned[0]
        time.sleep(0.05)
    raise AssertionError("the trainer started no rollout process")


def _run_and_kill_its_rollout_process(
    out: Path, server: str, ready: str, *overrides: str
) -> tuple[int, int, str, float]:
    """``moe-rl train`` in a group of its own; once ``out/ready`` is a file that is not empty its rollout process is
    SIGKILLed (alone).
    ``(exit code, killed pid, console, seconds from the kill to the trainer's exit)``, once no process of the run is
    left (10 s at most); the group is SIGKILLed whatever happens."""
    console = _console(out)
    with open(console, "w") as fh:
        proc = subprocess.Popen(
            train_cmd(out, server, *ARGS, *overrides), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        marker = out / ready
        deadline = time.monotonic() + 300
        while not (marker.is_file() and marker.stat().st_size) and time.monotonic() < deadline:
            assert proc.poll() is None, f"run ended before the kill:\n{console.read_text()[-3000:]}"
            time.sleep(0.05)
        victim = _rollout_process(proc.pid)
        subprocess.run(["kill", "-9", str(victim)], check=True)
        killed = time.monotonic()
        rc = proc.wait(timeout=300)
        exit_s = time.monotonic() - killed
        t0 = time.monotonic()
        while group_pids(proc.pid) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not group_pids(proc.pid), "a process of the run (a rollout or reward process) outlived it"
        return rc, victim, console.read_text(), exit_s
    finally:
        if group_pids(proc.pid):
            subprocess.run(["kill", "-9", f"-{proc.pid}"], check=False)


@pytest.fixture(scope="module")
def server(tiny_cpu_server) -> str:
    return tiny_cpu_server


def test_a_killed_rollout_process_is_restarted_and_every_step_is_trained_once(tmp_path, server):
    rc, victim, out, _ = _run_and_kill_its_rollout_process(tmp_path, server, "metrics.jsonl")  # step 1 trained
    assert rc == 0, out[-4000:]
    reports = [line for line in out.splitlines() if f"(pid {victim})" in line]
    assert len(reports) == 1, out[-4000:]
    assert re.fullmatch(
        rf"the rollout process \(pid {victim}\) died \(killed by SIGKILL\); restarted from step [2-3] "
        r"\(restart 1/2, rollout.max_process_restarts\)",
        reports[0],
    ), reports[0]
    assert "Traceback" not in out and "BrokenPipe" not in out, out[-4000:]
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3], "a step is missing or was trained twice"
    made = sorted(p.name for p in (tmp_path / "rollouts").glob("step_*.safetensors"))
    assert made == [f"step_{s:06d}.safetensors" for s in range(3)], made
    for s in range(3):  # each step's records were made for it: versions within the staleness bound
        batch = RolloutBatch.load(tmp_path / "rollouts" / f"step_{s:06d}.safetensors")
        assert s - 1 <= batch.token_versions.min() and batch.token_versions.max() <= s, f"step {s}: too stale"
    assert all(m["async/staleness_max"] <= 1 and m["async/dropped_stale"] == 0 for m in metrics)


def test_past_max_process_restarts_the_run_stops_with_one_line(tmp_path, server):
    first = "rollouts/step_000000.safetensors"  # the process has begun: a death now is past the bound at once
    rc, victim, out, exit_s = _run_and_kill_its_rollout_process(
        tmp_path, server, first, "rollout.max_process_restarts=0"
    )
    assert rc == 2, out[-4000:]
    assert "Traceback" not in out and "BrokenPipe" not in out, out[-4000:]
    last = out.strip().splitlines()[-1]
    assert last == (
        f"error: the rollout process (pid {victim}) died (killed by SIGKILL); "
        "all rollout.max_process_restarts=0 restarts are used"
    ), out[-3000:]
    assert [line for line in out.splitlines() if f"(pid {victim})" in line] == [last]
    assert exit_s < 20, f"the death was noticed {exit_s:.1f} s after the kill"
