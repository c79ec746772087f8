"""Dynamic sampling, overlong shaping and evaluation through the CLI with a real SGLang server (2 steps).

The built-in copy task on the random-init tiny model gives graded rewards, so some groups are all
equal (dropped) and some are not. Eval runs on held-out task prompts before step 1 and after each
step at the synced weights, and writes no training records.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from moe_rl.records import RolloutBatch
from moe_rl.train.metrics_log import read_metrics
from tests.conftest import run_to_file

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).parents[2]


def test_filters_and_eval_through_the_trainer(tmp_path, device, tiny_cpu_server):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        str(ROOT / "configs/tiny_cpu.yaml"),
        "train.steps=2",
        "train.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=8",
        "train.micro_batch_size=4",
        "logging.tensorboard=false",
        "logging.progress=false",
        "train.filter_groups=true",
        "train.max_generation_rounds=3",
        "train.filter_groups_fallback=true",
        "reward.overlong_buffer.length=2",
        "reward.overlong_buffer.penalty=0.5",
        "train.mask_truncated=true",
        "eval.interval=1",
        "eval.task_prompts=4",
        "eval.samples_per_prompt=3",
        "eval.temperature=0",
        f"train.output_dir={out}",
        f"rollout.addresses=[{tiny_cpu_server}]",
    ]
    proc, output = run_to_file(cmd, tmp_path / "console.txt", timeout=900)
    assert proc.returncode == 0, output[-4000:]
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert "eval task/pass@1" in output and "eval task/pass@3" in output  # the closing summary
    for m in metrics:  # before step 1, after each step
        assert {"eval/task/reward_mean", "eval/task/pass@1", "eval/task/pass@3"} <= m.keys(), m.keys()
        assert 0 <= m["eval/task/pass@1"] <= m["eval/task/pass@3"] <= 1
    for m in metrics[1:]:
        assert 1 <= m["filter/rounds"] <= 3 and m["filter/groups_seen"] == 4 * m["filter/rounds"]
        assert "reward/overlong_penalty_mean" in m and "response/masked_truncated" in m
    # greedy eval: the 3 samples of a prompt are the same response, so pass@3 == pass@1
    assert all(m["eval/task/pass@3"] == pytest.approx(m["eval/task/pass@1"]) for m in metrics)
    # the records hold exactly the trained batches: informative groups first, fallback groups counted
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == [
        "step_000000.safetensors",
        "step_000001.safetensors",
    ]
    for step, m in zip((0, 1), metrics[1:]):
        batch = RolloutBatch.load(out / "rollouts" / f"step_{step:06d}.safetensors")
        assert len(batch) == 16
        unequal = [np.ptp(g) > 0 for g in batch.rewards.reshape(4, 4)]
        assert sum(unequal) == 4 - m["filter/fallback_groups"], (batch.rewards, m)
