"""Resume rules through the trainer (records-replay mode, no server): raising ``train.steps`` on resume
equals a straight run (constant lr schedule), the KL anchor is this run's saved reference, and a
reference that is not complete is refused rather than rebuilt from the resumed weights."""

from __future__ import annotations

import subprocess
import sys

from moe_rl.train.metrics_log import read_metrics
from tests.train.records_fixture import CONFIG, RECORDS, SHAPE, initial_hf_dir

KEYS = ("train/loss", "train/grad_norm", "train/lr", "loss/kl_ref", "loss/total")


def _train(out, hf, steps, check=True):
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        str(CONFIG),
        *SHAPE,
        f"train.steps={steps}",
        f"train.rollouts_from={RECORDS}",
        f"checkpoint.init_from_hf={hf}",
        f"train.output_dir={out}",
        "checkpoint.save_interval=1",
        "loss.kl_coef=0.05",
        "train.minibatches_per_step=1",
        "correction.kl_alarm=null",  # records of another policy replayed on purpose: the KL alarm would skip them
        "precision.deterministic=true",
    ]  # on CUDA bitwise needs it (docs/gpu.md); a no-op on CPU
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_raising_train_steps_on_resume_equals_a_straight_run_and_keeps_the_reference(tmp_path, device):
    hf = initial_hf_dir(tmp_path / "hf")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(straight, hf, steps=2)
    _train(resumed, hf, steps=1)
    _train(resumed, hf, steps=2)  # train.steps raised on resume
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2]
    for ma, mb in zip(a, b):
        assert {k: ma[k] for k in KEYS} == {k: mb[k] for k in KEYS}
    # the step-2 KL is to the initial policy: a reference rebuilt from the resumed weights would give 0 there
    assert b[1]["loss/kl_ref"] > 0

    # an interrupted reference save (no completion marker) is refused, naming the cause and the way out
    (resumed / "checkpoints" / "reference" / "complete.json").unlink()
    proc = _train(resumed, hf, steps=3, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert "loss.kl_coef=0.05" in err and "is incomplete (no completion marker" in err and "is not rebuilt" in err
