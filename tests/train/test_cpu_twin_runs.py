"""The CPU twins train through the entry point a user runs: `torchrun --nproc-per-node 2 -m moe_rl.cli
train configs/cpu/<name>.yaml`, 2 ranks over gloo (ep=2; pp=2 for qwen3_235b_a22b), a real SGLang CPU server,
2 steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.learner.dist import free_port
from moe_rl.train.metrics_log import read_metrics
from tests.conftest import repo_env

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["logging.tensorboard=false", "logging.progress=false", "rollout.startup_timeout_s=600"]


def torchrun_train(config: Path, out_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "moe_rl.cli",
        "train",
        str(config),
        f"train.output_dir={out_dir}",
        *QUICK,
        *overrides,
    ]
    env = repo_env(ROOT, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)


@pytest.mark.sglang
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("twin", ["qwen3_30b_a3b", "deepseek_v3_style", "qwen3_235b_a22b"])  # the last: pp=2
def test_cpu_twin_trains_two_steps_on_two_ranks(twin, tmp_path):
    proc = torchrun_train(ROOT / f"configs/cpu/{twin}.yaml", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 0.0 <= m["reward/mean"] <= 1.0 and m["train/grad_norm"] > 0
        # R3: the learner dispatched exactly the rollout's routes, while its own router would differ
        assert m["replay/rollout_vs_dispatched/response/flip_rate"] == 0.0
        assert m["replay/rollout_vs_dispatched/prompt/flip_rate"] == 0.0
        assert m["replay/rollout_vs_natural/response/flip_rate"] >= 0.0
    assert "Keep Sampling Mask is a no-op" in proc.stderr  # both originals sample untruncated
    server_log = (tmp_path / "run" / "logs" / "sglang_0.log").read_text(errors="replace")
    assert "update_weights_from_distributed" in server_log, "the cluster configs sync over the network (distributed)"
