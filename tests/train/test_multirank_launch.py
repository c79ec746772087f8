"""The documented multi-rank command, run as a user runs it: ``NPROC=2 launch/local.sh CONFIG parallel.ep=2``.

Rank 0 of a torchrun job starts its own SGLang server (the server must not inherit torchrun's
RANK / WORLD_SIZE / MASTER_* rendezvous, or it never becomes healthy); both ranks train on its
rollouts with expert parallelism, ragged responses and several microbatches per minibatch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_rl.records import RolloutBatch
from moe_rl.rollout.server_spec import ServerSpec, server_env
from moe_rl.train.metrics_log import read_metrics
from tests.conftest import one_gpu_per_rank

pytestmark = [pytest.mark.sglang, pytest.mark.distributed]
REPO = Path(__file__).parents[2]


def _server_pid(model_path: Path) -> int | None:
    """The pid of the SGLang server launched for ``model_path`` (its ``sglang_entry`` process), if running."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"moe_rl.rollout.sglang_entry" in argv and str(model_path).encode() in argv:
            return int(proc.name)
    return None


KILLER = """
import os, signal, time
from pathlib import Path

RUN = Path({run!r})


def gone(proc):
    from moe_rl.rollout.orphan_guard import group_pids

    try:
        threads = int(next(line.split()[1] for line in (proc / "status").read_text().splitlines()
                           if line.startswith("Threads:")))
    except (OSError, StopIteration):
        return True
    return threads <= 1 and not group_pids(int(proc.name))  # a zombie leader, and nothing left of its group


def reward(prompt, response_ids):
    \"\"\"Kills the run's server (its group leader, not a forked scheduler) once, while scoring step 1's samples, and
    returns when it is dead; scores vary with the response so that advantages do.\"\"\"
    marker = RUN / "killed_between_batches"
    if (RUN / "rollouts" / "step_000000.safetensors").exists() and not marker.exists():
        marker.write_text("")
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\\0")
            except (OSError, ValueError):
                continue
            server = b"moe_rl.rollout.sglang_entry" in argv and str(RUN / "hf" / "current").encode() in argv
            if server and os.getpgid(int(proc.name)) == int(proc.name):
                os.kill(int(proc.name), signal.SIGKILL)
                while not gone(proc):  # its threads and its group too, not just the leader: dead, not dying
                    time.sleep(0.05)
    return (sum(response_ids) % 7) / 7.0
"""


@one_gpu_per_rank(2)
def test_two_rank_expert_parallel_async_run_starts_its_own_server_from_rank_0(tmp_path):
    """Also the asynchronous mode on two ranks: rank 0's producer runs one step ahead (max_staleness=1), and its
    server dies twice (issue 36, server life):

    - between two batches: the reward kills it while it scores step 1 (the producer then waits for version 1 and
      nothing sends it a request); the push of version 1 restarts it first and loads it through a new weight-update
      group opened on both ranks, instead of failing on a dead address;
    - while the producer generates step 2's batch: the rollout process asks rank 0 to restart it and to re-sync from
      the live weights of both ranks (issue 35: collective, no host copy; the main thread runs it at its next wait).
      That wait is the push of version 2 (the learner has trained step 1): the live weights are version 2, and step
      2's batch, regenerated on them, is labelled 2 (it was labelled 1, the version last pushed)."""
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "killer.py").write_text(KILLER.format(run=str(tmp_path / "run")))
    env = {
        **os.environ,
        "NPROC": "2",
        "MOE_RL_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "hooks"), os.environ.get("PYTHONPATH", "")]),
    }
    run = tmp_path / "run"
    cmd = [
        "bash",
        str(REPO / "launch/local.sh"),
        str(REPO / "configs/tiny_cpu.yaml"),
        "parallel.ep=2",
        "train.steps=3",
        "train.rollout_mode=async",
        "train.max_staleness=1",
        "train.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=48",
        "train.micro_batch_size=2",
        "logging.tensorboard=false",
        "logging.progress=false",
        "rollout.startup_timeout_s=600",
        "rollout.max_server_restarts=2",
        "train.reward_fn=killer:reward",
        "eval.interval=2",
        "eval.task_prompts=2",
        "eval.samples_per_prompt=2",  # rank 0 evaluates; rank 1 follows
        f"train.output_dir={run}",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 600
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            # version 1 is pushed (step 1's line follows it) and step 2's batch not yet written: it is generating
            if (
                (run / "metrics.jsonl").is_file()
                and any(m["step"] >= 1 for m in read_metrics(run / "metrics.jsonl"))
                and not (run / "rollouts" / "step_000002.safetensors").exists()
            ):
                killed = _server_pid(run / "hf" / "current")
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.02)
        _, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"NPROC=2 launch/local.sh ... parallel.ep=2 failed:\n{stderr[-4000:]}"
    assert killed is not None, "the server was not killed while step 2's batch was being made"
    assert (run / "killed_between_batches").exists(), "the reward never killed the server"
    assert "restart 1/2" in stderr and "restart 2/2" in stderr and "re-syncing" in stderr, stderr[-3000:]
    first_failure = stderr.index("rollout failed")  # the request that met the server killed during step 2
    assert stderr.index("restart 1/2") < first_failure, "a request reached the server killed between batches"
    lines = read_metrics(run / "metrics.jsonl")
    metrics = [m for m in lines if "time/rollout_s" in m]  # the RL steps (step 0's line is the first eval's)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["step"] for m in lines if "time/eval_s" in m] == [2, 3], "evaluated after steps 2 and 3"
    assert [m["async/staleness_mean"] for m in metrics] == [0.0, 1.0, 0.0]
    assert all(m["async/staleness_max"] <= 1 and m["async/dropped_stale"] == 0 for m in metrics)
    for s in range(3):
        versions = RolloutBatch.load(run / "rollouts" / f"step_{s:06d}.safetensors").token_versions
        assert max(s - 1, 0) <= versions.min() and versions.max() <= s
    versions = [
        set(RolloutBatch.load(run / "rollouts" / f"step_{s:06d}.safetensors").token_versions.tolist()) for s in range(3)
    ]
    assert versions == [{0}, {0}, {2}]  # step 1's batch was made before the first kill
    assert all(m["replay/rollout_vs_dispatched/response/flip_rate"] == 0.0 for m in metrics)
    assert all(m["train/grad_norm"] > 0 for m in metrics)
    assert (run / "logs" / "sglang_0.log").is_file(), "rank 0 should have started (and logged) its own server"


def test_the_server_environment_drops_the_learners_rendezvous_variables():
    torchrun = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
        "GROUP_RANK": "0",
        "PATH": "/usr/bin",
    }
    env = server_env(ServerSpec(model_path="/m"), base=torchrun)
    assert env["PATH"] == "/usr/bin"
    leaked = sorted(k for k in torchrun if k != "PATH" and k in env)
    assert not leaked, f"the SGLang server would join the learner's process group through {leaked}"
