"""``train.mask_truncated`` through the trainer (records-replay mode, no server): responses that hit
``rollout.max_new_tokens`` never enter the loss."""

from __future__ import annotations

import subprocess
import sys

from moe_rl.records import RolloutBatch
from moe_rl.train.metrics_log import read_metrics
from tests.train.records_fixture import CONFIG, RECORDS, SHAPE, initial_hf_dir


def test_truncated_responses_leave_the_loss(tmp_path, device):
    # every sample of the step hit max_new_tokens: with mask_truncated no token enters the loss, so the
    # loss and the gradient are exactly zero (aux loss 0 in tiny_cpu); without it the step trains
    records = tmp_path / "records"
    records.mkdir()
    batch = RolloutBatch.load(RECORDS / "step_000000.safetensors")
    batch.finish_reasons = ["length"] * len(batch)
    batch.save(records / "step_000000.safetensors")
    hf = initial_hf_dir(tmp_path / "hf")

    def run(name, *extra):
        out = tmp_path / name
        cmd = [
            sys.executable,
            "-m",
            "moe_rl.cli",
            "train",
            str(CONFIG),
            *SHAPE,
            "train.steps=1",
            "train.minibatches_per_step=1",
            f"train.rollouts_from={records}",
            f"checkpoint.init_from_hf={hf}",
            f"train.output_dir={out}",
            *extra,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (m,) = read_metrics(out / "metrics.jsonl")
        return m

    masked = run("masked", "train.mask_truncated=true")
    assert masked["response/masked_truncated"] == len(batch) and masked["response/truncated_frac"] == 1.0
    assert masked["train/loss"] == 0.0 and masked["train/grad_norm"] == 0.0, masked
