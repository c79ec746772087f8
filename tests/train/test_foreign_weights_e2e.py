"""Issue 38's operator walk-through through ``moe-rl train`` (a real subprocess with its own SGLang server).

The run's admin key is configured (``rollout.admin_api_key_env``), standing for a leaked one. Meanwhile an
"attacker" holding it reads the run's current label from ``/model_info`` and keeps pushing another model of
the same architecture under that label, so its pushes land at every moment of the run (between a push and
its label check, during generation, between a batch and its fingerprint check). Whatever happens, no
training step uses the foreign weights (no metrics row with ``offpolicy/kl_k3`` above the alarm), the log
names "foreign weights" with both fingerprints, and the run stops with one line (exit code 2), never a
traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest

from moe_rl.config import load_config
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.rollout.auth import RUN_ADMIN_KEY_ENV
from moe_rl.train.metrics_log import read_metrics
from tests.train.ops_probes import server_of, start_like_a_terminal

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).parents[2]
KEY_ENV, KEY = "MOE_RL_WALKTHROUGH_ADMIN", "moe-rl-walkthrough-leaked-admin-key-3e91"


def _attack(url: str, foreign_dir: Path, stop: threading.Event, pushes: list) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60, headers=headers) as http:
        while not stop.is_set():
            try:
                label = http.get(f"{url}/model_info").json()["weight_version"]
                body = {"model_path": str(foreign_dir), "weight_version": label, "flush_cache": True}
                if http.post(f"{url}/update_weights_from_disk", json=body).status_code == 200:
                    pushes.append(label)
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # the server went away with the run
            stop.wait(0.3)


@pytest.mark.timeout(1800)  # at load 40-70 on 2 cores the server start alone took over 15 minutes
def test_another_model_pushed_under_the_runs_label_is_never_trained_on(tmp_path):
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml")
    foreign = write_random_hf_checkpoint(cfg.model, tmp_path / "foreign", seed=77)
    run = tmp_path / "run"
    # mem_fraction_static 0.3: a shared host's RAM moves while SGLang measures it (docs/sglang.md)
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        str(ROOT / "configs/tiny_cpu.yaml"),
        "train.steps=3",
        f"train.output_dir={run}",
        f"rollout.admin_api_key_env={KEY_ENV}",
        "logging.tensorboard=false",
        "logging.progress=false",
        "rollout.startup_timeout_s=600",
        "checkpoint.save_interval=0",
        "rollout.mem_fraction_static=0.3",
    ]
    env = {k: v for k, v in os.environ.items() if k != RUN_ADMIN_KEY_ENV} | {"PYTHONPATH": str(ROOT), KEY_ENV: KEY}
    trainer = start_like_a_terminal(cmd, env, stdout=-1, stderr=-1, text=True)
    stop, pushes = threading.Event(), []
    try:
        _, url = server_of(run, trainer, timeout_s=900)
        attacker = threading.Thread(target=_attack, args=(url, foreign, stop, pushes), daemon=True)
        attacker.start()
        out, err = trainer.communicate(timeout=600)
    finally:
        stop.set()
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    assert pushes, "the attacker never got a foreign push in"
    assert "Traceback" not in err and "Traceback" not in out, err[-4000:]
    assert "foreign weights" in err, err[-4000:]
    assert trainer.returncode in (0, 2), err[-4000:]
    if trainer.returncode == 2:  # stopped: the reason in one line
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "foreign weights" in errors[0], err[-4000:]
    alarm = cfg.correction.kl_alarm
    rows = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    assert all(r.get("offpolicy/kl_k3", 0.0) <= alarm for r in rows), rows
    outcome = "stopped: " + errors[0] if trainer.returncode == 2 else f"recovered: {len(rows)} steps trained"
    print(f"\nwalk-through: {len(pushes)} foreign pushes landed; {outcome}")
