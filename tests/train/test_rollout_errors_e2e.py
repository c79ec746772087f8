"""A batch the server will not generate ends the run with one line naming the server and the reply, never a
traceback: the session server behind a proxy that refuses every ``/generate`` (HTTP 400), tiny_cpu, one step."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import run_to_file
from tests.http_proxy import Proxy

ROOT = Path(__file__).parents[2]


def _refuse_generate(path: str, body: bytes, reply: httpx.Response) -> tuple[int, bytes] | None:
    if path == "/generate":
        return 400, b'{"error": {"message": "prompt too long for this deployment"}}'
    return None


@pytest.mark.sglang
def test_a_refused_generate_ends_the_run_with_one_line(tiny_cpu_server, tmp_path, device):
    out = tmp_path / "run"
    with Proxy(tiny_cpu_server, _refuse_generate) as proxy:
        cmd = [sys.executable, "-m", "moe_rl.cli", "train", str(ROOT / "configs/tiny_cpu.yaml")]
        cmd += [f"train.output_dir={out}", f"rollout.addresses=[{proxy.url}]", "train.steps=1"]
        cmd += ["checkpoint.save_interval=0", "logging.tensorboard=false", "logging.progress=false"]
        proc, output = run_to_file(cmd, tmp_path / "console.txt", timeout=600)
    assert proc.returncode == 2 and "Traceback" not in output, output[-4000:]
    (error,) = [line for line in output.splitlines() if line.startswith("error: ")]
    assert proxy.url in error and "400" in error and "prompt too long for this deployment" in error, error
    assert not (out / "rollouts").exists() or not any((out / "rollouts").iterdir()), "nothing half-made is kept"
