"""``moe-rl certify``: passes (exit 0, every number 0.0) on tiny_cpu in the mode, fails (exit 1, the attribution
table printed) in normal bf16 mode. Both run as a user runs them, on the session's servers (``rollout.addresses``:
the gate's true-on-policy server, and tests/conftest.py's stock tiny_cpu one); the verdict's rules are unit-tested."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moe_rl.cli import main
from moe_rl.config.kernels import KERNELS
from moe_rl.study.certify import certify_verdict
from tests.conftest import run_to_file

ROOT = Path(__file__).parents[2]
SMALL = ["rollout.samples_per_prompt=4", "rollout.max_new_tokens=4", "train.micro_batch_size=8"]
TABLE_HEAD = (
    "| kernels on | KL k3 | max \\|Δlogp\\| | mean \\|Δlogp\\| | router flips (prompt) | router flips (response) |"
)


def _certify(tmp_path: Path, server: str, *overrides: str) -> tuple[int, str, dict]:
    out = tmp_path / "certify.json"
    cmd = [sys.executable, "-m", "moe_rl.cli", "certify", str(ROOT / "configs/tiny_cpu.yaml"), *SMALL, *overrides]
    cmd += [f"rollout.addresses=[{server}]", f"train.output_dir={tmp_path / 'run'}", "--prompts", "2", "--json"]
    proc, output = run_to_file([*cmd, str(out)], tmp_path / "console.txt", timeout=600)
    return proc.returncode, output, json.loads(out.read_text()) if out.is_file() else {}


@pytest.mark.sglang
def test_certify_passes_in_the_mode_with_keep_sampling_mask(tmp_path, tiny_server):
    rc, output, numbers = _certify(tmp_path, tiny_server, "rollout.true_on_policy=true", "rollout.dtype=float32")
    assert rc == 0, output[-4000:]
    # tiny_cpu as shipped keeps Keep Sampling Mask on: the full-vocab and the kept-set log-probs are both gated
    assert set(numbers["rows"]) == {"all", "all_kept"}, numbers
    for row in numbers["rows"].values():
        assert 0 < row["tokens"] <= 2 * 4 * 4
        assert [row[k] for k in ("dlogp_max", "kl_k3", "flip_prompt", "flip_response")] == [0.0] * 4, row
    assert numbers["contract"] == {k: {"learner": True, "servers": True} for k in KERNELS}
    assert numbers["passed"] and output.rstrip().splitlines()[-1].startswith("certify: PASS: ")
    assert TABLE_HEAD in output and "| `router` | shared | shared |" in output


@pytest.mark.sglang
def test_certify_fails_in_normal_bf16_mode_with_the_attribution_table(tmp_path, tiny_cpu_server):
    rc, output, numbers = _certify(tmp_path, tiny_cpu_server)
    assert rc == 1, output[-4000:]
    verdict = output.rstrip().splitlines()[-1]
    assert verdict.startswith("certify: FAIL: normal mode (rollout.true_on_policy=false)"), output[-4000:]
    assert "attribution table" in output and TABLE_HEAD in output and "| none (stock) |" in output
    # one server is given: the rest of the table needs a server per row, and tiny_cpu (bf16 rollout, fp32
    # learner) cannot be exact anyway; the note says so
    assert "only the stock row was measured" in output and "rollout.addresses" in output
    stock = numbers["rows"]["stock"]
    assert stock["kl_k3"] > 0 and stock["dlogp_max"] > 0 and not numbers["passed"], numbers


def _numbers(mode="true_on_policy", shared=True, **row):
    base = {"kl_k3": 0.0, "dlogp_max": 0.0, "dlogp_mean": 0.0, "flip_prompt": 0.0, "flip_response": 0.0}
    numbers = {"mode": mode, "rows": {"all" if mode == "true_on_policy" else "stock": {**base, "tokens": 16, **row}}}
    if mode == "true_on_policy":
        numbers["contract"] = {k: {"learner": True, "servers": shared or k != "router"} for k in KERNELS}
    return numbers


def _attribution():
    numbers = _numbers(mode="normal")
    row = numbers["rows"].pop("stock")
    numbers["rows"] = {"stock": {**row, "kl_k3": 4e-6}, "+router": {**row, "kl_k3": 5e-6}, "all": row}
    return numbers


@pytest.mark.parametrize(
    ("numbers", "passed", "says"),
    [
        (_numbers(), True, "certify: PASS: rollout and learner agree bit for bit"),
        (_numbers(dlogp_max=2**-24), False, "max |Δlogp|=5.96e-08"),
        (_numbers(kl_k3=1e-12), False, "KL k3=1e-12"),
        (_numbers(flip_response=0.01), False, "router flips (response)=0.01"),
        (_numbers(flip_prompt=float("nan")), False, "router flips (prompt)=nan"),
        (_numbers(tokens=0), False, "no response tokens were measured"),
        (_numbers(shared=False), False, "not every contract item is shared on both sides"),
        (_numbers(mode="normal"), False, "normal mode (rollout.true_on_policy=false) is never certified"),
        (_attribution(), False, "KL k3=4e-06"),  # the config's own (stock) row, not the attribution rows
    ],
)
def test_any_difference_fails_the_verdict(numbers, passed, says):
    ok, line = certify_verdict(numbers)
    assert ok is passed and says in line, line
    assert line.startswith("certify: PASS: " if passed else "certify: FAIL: ")


def test_bad_flags_are_one_clear_error(capsys):
    assert main(["certify", str(ROOT / "configs/tiny_cpu.yaml"), "--prompts", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: certify --prompts=0; expected >= 1"
