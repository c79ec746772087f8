"""CI smoke test of `make demo`'s config: warm start (cold cache) + the first RL steps, through the CLI.

Real SGLang CPU server, real Megatron-Core learner; the warm-start cache lives in a temp dir so
the supervised phase really runs. Budget: <= 2 minutes on 2 idle cores (issue 15).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moe_rl.records import RolloutBatch
from moe_rl.tasks.tokenizer import EOS_ID
from moe_rl.train.metrics_log import read_metrics

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        str(ROOT / "configs/demo.yaml"),
        "train.steps=2",
        f"train.output_dir={out / 'run'}",
        f"train.warm_start.cache_dir={out / 'cache'}",
        "logging.progress=false",
        "checkpoint.save_interval=0",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"moe-rl train failed:\n{proc.stderr[-4000:]}"
    seconds = time.perf_counter() - t0  # budget 120 s on 2 idle cores; a shared machine is slower, so no assert
    print(f"demo smoke (cold warm start + 2 RL steps): {seconds:.0f} s")
    return out, proc, seconds


def test_warm_start_ran_cold_and_was_cached(demo_run):
    out, proc, _ = demo_run
    (key_dir,) = (out / "cache").iterdir()
    assert sorted(p.name for p in key_dir.iterdir()) == ["meta.json", "rank_00000.safetensors"]
    history = json.loads((key_dir / "meta.json").read_text())["history"]
    assert history[-1]["nll"] < 0.6 * history[0]["nll"]  # the supervised phase learned something
    assert "[warm start] trained" in proc.stderr


def test_first_rl_steps_start_from_the_warm_policy_with_long_eos_terminated_ragged_responses(demo_run):
    out, _, _ = demo_run
    metrics = read_metrics(out / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    # a random-init policy scores ~0.05 on this task (docs/demo); the warm start must show
    assert metrics[0]["reward/mean"] > 0.25
    batch = RolloutBatch.load(out / "run" / "rollouts" / "step_000000.safetensors")
    lens = np.asarray(batch.response_lens)
    ends_with_eos = np.array([int(s.response_ids[-1]) == EOS_ID for s in batch.samples()])
    assert np.mean(ends_with_eos) > 0.5
    finished = lens[ends_with_eos]  # answers are 7-11 digits + eos; a short-trained policy may stop early now and then
    # One warm start's outcome, and it depends on the CPU's numerics (the run is bit-reproducible on one machine):
    # the share of answer-length replies was > 0.9 on the 2-core machines of earlier sessions, 0.880 on an AMX
    # Xeon (the same with the code before issue 36's last change) and 0.838 there with torch/oneDNN/MKL held to
    # AVX2. So "long" is asserted where every measured machine agrees: most finished replies are answer-length and
    # the typical one is (a policy that stops early -- e.g. a failed warm start -- fails both).
    assert np.mean(finished >= 8) > 0.75 and np.median(finished) >= 8, finished
    assert len(set(finished.tolist())) >= 3


def test_closing_summary_names_reward_and_where_the_outputs_are(demo_run):
    out, proc, _ = demo_run
    text = proc.stdout
    metrics = read_metrics(out / "run" / "metrics.jsonl")
    first, last = metrics[0]["reward/mean"], metrics[-1]["reward/mean"]
    assert "mean reward" in text and f"{first:.3f} (step 1) -> {last:.3f} (step 2)" in text
    for expected in (
        "KL k3 rollout vs learner",
        "router flip rate rollout vs dispatched",
        str(out / "run" / "metrics.jsonl"),
        str(out / "run" / "rollouts"),
        f"tensorboard --logdir {out / 'run' / 'tensorboard'}",
    ):
        assert expected in text, expected
    assert (out / "run" / "report" / "plots" / "reward_mean.png").exists()
