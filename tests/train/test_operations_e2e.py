"""Issue 25 through ``moe-rl train`` (real subprocesses, each with its own SGLang server):

- secure by default: with no key configured the run's server gets a fresh admin key, an unauthenticated
  weight update is refused with 401 while the run trains on, and the key is in no file of the run;
- labels carry the run nonce (``step-<s>-<nonce>``);
- no ``/dev/shm`` entry outlives a run that ends normally or by a server crash (Ctrl-C: test_run_dir_e2e).
"""

from __future__ import annotations

import os
import signal
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
from tests.rollout.test_launcher import _pids_mentioning
from tests.train.ops_probes import ShmWatch, server_of, shm_left_over, shm_snapshot, start_like_a_terminal

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).parents[2]
BASE = [
    sys.executable,
    "-m",
    "moe_rl.cli",
    "train",
    str(ROOT / "configs/tiny_cpu.yaml"),
    "logging.tensorboard=false",
    "logging.progress=false",
    "rollout.startup_timeout_s=600",
]
ENV = {k: v for k, v in repo_env(ROOT).items() if k != RUN_ADMIN_KEY_ENV}


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_no_key_configured_a_weight_update_without_the_runs_key_is_refused_while_the_run_trains_on(tmp_path):
    before = shm_snapshot()
    trainer = start_like_a_terminal(
        [*BASE, "train.steps=1", f"train.output_dir={tmp_path}"], ENV, stdout=-1, stderr=-1, text=True
    )
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
