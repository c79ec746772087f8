"""The closing summary of `moe-rl train`: numbers read from metrics.jsonl, paths that exist, no invented lines."""

from __future__ import annotations

import json
from pathlib import Path

from moe_rl.study.summary import closing_summary


def _run(tmp_path: Path, records: list[dict], tensorboard: bool = True) -> Path:
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    (run / "checkpoints" / "step_00000003").mkdir(parents=True)
    (run / "rollouts" / "step_000002.safetensors").write_bytes(b"")
    if tensorboard:
        (run / "tensorboard").mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_summary_gives_first_last_and_max_reward_kl_flip_and_paths(tmp_path):
    flip = "replay/rollout_vs_dispatched/response/flip_rate"
    records = [
        {"step": 1, "reward/mean": 0.412, "offpolicy/kl_k3": 2.5e-4, flip: 0.05},
        {"step": 2, "reward/mean": 0.903, "offpolicy/kl_k3": 1.0e-4, flip: 0.02},
        {"step": 3, "reward/mean": 0.871, "offpolicy/kl_k3": 3.0e-5, flip: 0.0125},
    ]
    run = _run(tmp_path, records)
    text = closing_summary(run)
    assert "3 step(s)" in text
    assert "0.412 (step 1) -> 0.871 (step 3), max 0.903" in text
    assert "2.50e-04 (step 1) -> 3.00e-05 (step 3)" in text
    assert "router flip rate rollout vs dispatched" in text and "5.00% (step 1) -> 1.25% (step 3)" in text
    assert f"tensorboard --logdir {run / 'tensorboard'}" in text
    assert str(run / "metrics.jsonl") in text and "step_00000003" in text and "1 files" in text
    assert (run / "report" / "plots" / "reward_mean.png").exists() and str(run / "report" / "plots") in text
    assert (
        "applied" not in text and "flip rate rollout vs learner" not in text
    )  # metrics the run did not log get no line


def test_summary_without_tensorboard_or_steps_says_so(tmp_path):
    run = _run(tmp_path, [{"step": 1, "reward/mean": 0.5}], tensorboard=False)
    assert "tensorboard" not in closing_summary(run, plots=False)
    assert "no metrics.jsonl" in closing_summary(tmp_path / "nothing")
