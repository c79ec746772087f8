"""Metrics sinks: JSONL lines per step, resume truncation (including a torn last line), TensorBoard files."""

from __future__ import annotations

import json
import sys
import types

from moe_rl.config import LoggingConfig
from moe_rl.train.metrics_log import MetricsLogger, read_metrics, wandb_init_kwargs


def test_resume_cuts_lines_after_the_checkpoint_and_a_torn_tail(tmp_path):
    cfg = LoggingConfig(tensorboard=False, progress=False)
    logger = MetricsLogger(tmp_path, cfg, total_steps=5)
    for step in (1, 2, 3):
        logger.log(step, {"reward/mean": 0.1 * step, "offpolicy/kl_k3": float("nan")})
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "reward/me')  # killed mid-write
    resumed = MetricsLogger(tmp_path, cfg, total_steps=5, start_step=2)
    resumed.log(3, {"reward/mean": 0.7})
    resumed.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["reward/mean"] == 0.7
    assert rows[0]["offpolicy/kl_k3"] is None  # non-finite values are written as null, never as NaN tokens
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])  # strict JSON


def test_tensorboard_event_file_is_written(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(progress=False), total_steps=1)
    logger.log(1, {"reward/mean": 0.5})
    logger.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_non_main_ranks_write_nothing(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(progress=False), total_steps=1, enabled=False)
    logger.log(1, {"reward/mean": 0.5})
    logger.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_wandb_resumes_the_same_run_id(tmp_path, monkeypatch):
    """wandb (optional, not installed here): a stand-in module records what MetricsLogger asks of ``wandb.init``;
    a fresh run and its resume pass the same id, so wandb continues one run instead of starting another."""

    calls = []
    stand_in = types.ModuleType("wandb")
    stand_in.init = lambda **kw: (
        calls.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    )
    monkeypatch.setitem(sys.modules, "wandb", stand_in)
    cfg = LoggingConfig(tensorboard=False, progress=False, wandb=True, wandb_mode="offline")
    for start in (0, 2):  # the fresh run, then its resume
        MetricsLogger(tmp_path, cfg, total_steps=5, start_step=start, run_id="0123456789ab").close()
    assert [c["id"] for c in calls] == ["0123456789ab", "0123456789ab"]
    assert all(c["resume"] == "allow" and c["mode"] == "offline" for c in calls)
    assert "id" not in wandb_init_kwargs(cfg, tmp_path, "x", None)
