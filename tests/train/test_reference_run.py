"""``loss.kl_coef > 0`` trains: a frozen reference policy routed like π_old, its KL logged every step,
saved with the first checkpoint (records-replay mode: no server)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_rl.train.metrics_log import read_metrics
from tests.train.records_fixture import CONFIG, RECORDS, SHAPE, initial_hf_dir


@pytest.mark.parametrize("routing", ["r3"])
def test_kl_to_the_reference_is_logged_and_the_reference_is_checkpointed(tmp_path, routing, device):
    hf = initial_hf_dir(tmp_path / "hf")
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        str(CONFIG),
        *SHAPE,
        "train.steps=2",
        f"train.rollouts_from={RECORDS}",
        f"checkpoint.init_from_hf={hf}",
        f"train.output_dir={out}",
        "loss.kl_coef=0.01",
        f"replay.routing={routing}",
        "optim.ess_lr_scaling=true",
        "train.micro_batch_size=3",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(out / "metrics.jsonl")
    kl = [m["loss/kl_ref"] for m in metrics]
    assert all(k >= 0 for k in kl) and kl[1] > 0, f"KL to the reference should grow once the policy moves: {kl}"
    assert all(0 < m["vcpo/lr_scale"] <= 1 for m in metrics)
    assert (out / "checkpoints" / "reference" / "model-r00000.safetensors").is_file(), "reference not saved"
