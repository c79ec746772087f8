"""M2PO and VCPO act through the trainer (records-replay mode, no server).

The committed records' behaviour log-probs μ are lowered by |N(0, 0.5)| nats per token: a large
engine mismatch, as FP8 rollouts or a stale async producer give. With one minibatch per step the
first (and only) update has π_θ = π_old, so a mask or lr rule measured on π_θ/π_old cannot act;
seed 000 bounds the ratio to the *behaviour* policy, which these runs must see.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from moe_rl.records import RolloutBatch
from moe_rl.train.metrics_log import read_metrics
from tests.train.records_fixture import CONFIG, RECORDS, SHAPE, initial_hf_dir


def _noisy_records(out):
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for f in sorted(RECORDS.glob("step_*.safetensors")):
        batch = RolloutBatch.load(f)
        noise = np.abs(rng.normal(0.0, 0.5, size=batch.rollout_logp.shape)).astype(np.float32)
        batch.rollout_logp = batch.rollout_logp - noise
        if batch.sampling_logp is not None:
            batch.sampling_logp = batch.sampling_logp - noise
        batch.save(out / f.name)
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corrections")
    return _noisy_records(tmp / "records"), initial_hf_dir(tmp / "hf")


def _train(tmp_path, inputs, *overrides):
    records, hf = inputs
    out = tmp_path / "run"
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
        "checkpoint.save_interval=0",
        "correction.kl_alarm=null",
        *overrides,
    ]  # the records are made far off-policy on purpose
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = read_metrics(out / "metrics.jsonl")
    return metrics


def test_m2po_masks_on_the_first_minibatch_in_decoupled_mode(tmp_path, inputs, device):
    m = _train(tmp_path, inputs, "correction.mode=decoupled", "correction.m2po_tau=0.04")
    assert m["m2po/m2_before"] > 0.1, m  # (log π_old − log μ)², not (log π_θ − log π_old)² = 0
    assert 0.1 < m["m2po/masked_frac"] < 1.0, m
    assert 0 < m["m2po/m2_after"] <= 0.04 + 1e-6, m


def test_vcpo_reads_the_policy_in_plain_bypass_mode(tmp_path, inputs, device):
    # no other correction: only optim.ess_lr_scaling asks for the pre-pass π_θ
    m = _train(tmp_path, inputs, "correction.mode=bypass", "correction.icepop=false", "optim.ess_lr_scaling=true")
    assert m["vcpo/ess_frac"] < 0.9 and m["vcpo/lr_scale"] < 0.95, m  # sg[π_θ]/μ, not μ/μ ≡ 1
