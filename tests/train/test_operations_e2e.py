"""Issue 25 through ``moe-rl train`` (real subprocesses, each with its own SGLang server):

- secure by default: with no key configured the run's server gets a fresh admin key, an unauthenticated
  weight update is refused with 401 while the run trains on, and the key is in no file of the run;
- labels carry the run nonce (``step-<s>-<nonce>``);
- no ``/dev/shm`` entry outlives a run that ends normally or by a server crash (Ctrl-C: test_run_dir_e2e).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from moe_rl.records import RolloutBatch
from moe_rl.rollout.auth import RUN_ADMIN_KEY_ENV
from moe_rl.train.metrics_log import read_metrics
from moe_rl.train.run_identity import read_run_id, version_nonce
from tests.conftest import repo_env
from tests.ops_probes import ShmWatch, server_of, shm_left_over, shm_snapshot, start_like_a_terminal
from tests.rollout.test_launcher import _pids_mentioning

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).parents[2]
BASE = [sys.executable, "-m", "moe_rl.cli", "train", str(ROOT / "configs/tiny_cpu.yaml"), "logging.tensorboard=false",
        "logging.progress=false", "rollout.startup_timeout_s=600"]  # fmt: skip
ENV = {k: v for k, v in repo_env(ROOT).items() if k != RUN_ADMIN_KEY_ENV}


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_no_key_configured_a_weight_update_without_the_runs_key_is_refused_while_the_run_trains_on(tmp_path):
    before = shm_snapshot()
    trainer = start_like_a_terminal([*BASE, "train.steps=1", f"train.output_dir={tmp_path}"], ENV,
                                    stdout=-1, stderr=-1, text=True)  # fmt: skip
    watch = ShmWatch(trainer.pid)
    watch.start()
    try:
        pid, url = server_of(tmp_path, trainer)
        attack = {"model_path": str(tmp_path / "hf" / "current"), "weight_version": "step-0", "flush_cache": True}
        assert httpx.post(f"{url}/update_weights_from_disk", json=attack, timeout=60).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert httpx.post(f"{url}/update_weights_from_disk", json=attack, headers=wrong, timeout=60).status_code == 401
        key = _environ_of(pid)[RUN_ADMIN_KEY_ENV]  # handed to the server through its environment only
        assert len(key) >= 32 and RUN_ADMIN_KEY_ENV not in _environ_of(trainer.pid)
        assert not [p for p in _pids_mentioning(key)], "the key is on a command line"
        out, err = trainer.communicate(timeout=600)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    assert trainer.returncode == 0, err[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1]  # the run trained on
    for path in [p for p in tmp_path.rglob("*") if p.is_file()]:  # logs, config, records, checkpoints
        assert key.encode() not in path.read_bytes(), f"the run's key is written to {path}"
    assert key not in out + err
    # the label carries the run nonce; every sample came from the weights the trainer synced
    nonce = version_nonce(read_run_id(tmp_path))
    batch = RolloutBatch.load(tmp_path / "rollouts" / "step_000000.safetensors")
    assert set(batch.weight_versions) == {f"step-0-{nonce}"}
    assert shm_left_over(before, watch.stop()) == [], "a /dev/shm entry outlived a normal run"


def test_a_server_crash_that_ends_the_run_leaves_no_shm_entry_and_no_process(tmp_path):
    before = shm_snapshot()
    cmd = [*BASE, "train.steps=1", "rollout.max_server_restarts=0", f"train.output_dir={tmp_path}"]
    trainer = start_like_a_terminal(cmd, ENV, stdout=-1, stderr=-1, text=True)
    watch = ShmWatch(trainer.pid)
    watch.start()
    try:
        pid, _ = server_of(tmp_path, trainer)
        log = tmp_path / "logs" / "sglang_0.log"  # the trainer's first weight update: past its start-up bookkeeping
        while "POST /update_weights_from_disk" not in log.read_text(errors="replace") and trainer.poll() is None:
            time.sleep(0.2)
        os.killpg(pid, signal.SIGKILL)  # the whole server group dies at once: no handler, no finalizer runs
        _, err = trainer.communicate(timeout=600)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    assert trainer.returncode not in (0, None), err[-3000:]
    assert _pids_mentioning(str(tmp_path)) == [], "a server process outlived the run"
    assert shm_left_over(before, watch.stop()) == [], "a /dev/shm entry of the crashed server outlived the run"


KILLER = '''
import os, signal, time
from pathlib import Path

RUN = Path({run!r})


def reward(prompt, response_ids):
    """Scores step 1's samples (step 0's records are written) after killing the run's server, once."""
    marker = RUN.parent / "killed"
    if (RUN / "rollouts" / "step_000000.safetensors").exists() and not marker.exists():
        marker.write_text("")
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\\0")
            except (OSError, ValueError):
                continue
            server = b"moe_rl.rollout.sglang_entry" in argv and str(RUN / "hf" / "current").encode() in argv
            if server and os.getpgid(int(proc.name)) == int(proc.name):  # the leader, not a forked scheduler
                os.kill(int(proc.name), signal.SIGKILL)
                while (proc / "stat").exists() and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    time.sleep(0.05)  # dead (a zombie until the trainer reaps it), not dying: between batches
    return float(len(response_ids))
'''


def test_a_server_dead_since_its_last_batch_is_restarted_before_the_push_and_the_run_trains_on(tmp_path):
    """Issue 36: the server dies after step 1's batch (its reward kills it), while the producer (max_staleness=1)
    waits for version 1 and nothing sends it a request; the push of version 1 restarts it first (one supervisor,
    rank 0's pool) and syncs it with the others, instead of failing the run on a dead address."""
    run = tmp_path / "run"
    (tmp_path / "killer.py").write_text(KILLER.format(run=str(run)))
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV.get("PYTHONPATH", "")])}
    cmd = [*BASE, "train.steps=3", "train.rollout_mode=async", "train.max_staleness=1", "rollout.max_server_restarts=1",
           "train.reward_fn=killer:reward", "reward.num_workers=1", f"train.output_dir={run}"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "killed").exists(), "the reward never killed the server"
    assert "restart 1/1" in proc.stderr, proc.stderr[-3000:]
    assert "rollout failed" not in proc.stderr, "a request reached the dead server: the kill was not between batches"
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    nonce = version_nonce(read_run_id(run))
    for step, version in ((0, 0), (1, 0), (2, 1)):  # step 2's batch: the version pushed to the restarted server
        assert set(RolloutBatch.load(run / "rollouts" / f"step_{step:06d}.safetensors").weight_versions) == {
            f"step-{version}-{nonce}"}
