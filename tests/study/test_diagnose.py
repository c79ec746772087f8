"""`moe-rl diagnose`: zero-staleness gap under natural/R3/KSM, FP8-rollout injection, decision-tree verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_rl.study.diagnose_report import verdict
from moe_rl.sync.quantize import fake_quantize
from tests.conftest import run_to_file

ROOT = Path(__file__).parents[2]
ARGS = [
    "rollout.dtype=bfloat16",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "train.micro_batch_size=16",
]


def diagnose(out: Path, server: str, *overrides: str) -> dict:
    """``moe-rl diagnose`` on the session's tiny_cpu server (it loads the learner's export into it first)."""
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "diagnose",
        str(ROOT / "configs/tiny_cpu.yaml"),
        *ARGS,
        *overrides,
        f"rollout.addresses=[{server}]",
        "--prompts",
        "6",
        "--out",
        str(out),
    ]
    proc, output = run_to_file(cmd, out.parent / f"{out.name}.console.txt", timeout=600)
    assert proc.returncode == 0, output[-4000:]
    return json.loads((out / "numbers.json").read_text())


@pytest.fixture(scope="module")
def reports(tmp_path_factory, tiny_cpu_server):
    bf16 = tmp_path_factory.mktemp("bf16")
    fp8 = tmp_path_factory.mktemp("fp8")
    return (bf16, diagnose(bf16, tiny_cpu_server)), (
        fp8,
        diagnose(fp8, tiny_cpu_server, "rollout.weight_quantization=fp8_e4m3"),
    )


@pytest.mark.sglang
def test_report_files_are_written(reports):
    for out, numbers in reports:
        for name in (
            "report.md",
            "numbers.json",
            "per_token.npz",
            "flip_rate_per_layer.png",
            "abs_dp_by_position.png",
            "log_ratio_hist.png",
        ):
            assert (out / name).stat().st_size > 100, name
        assert set(numbers["settings"]) == {"natural", "r3", "ksm", "r3_ksm"}
        # the report folder holds the report and its evidence, not the scratch run (weights, checkpoints)
        assert sorted(p.name for p in out.iterdir()) == sorted(
            [
                "report.md",
                "numbers.json",
                "per_token.npz",
                "rollouts.safetensors",
                "flip_rate_per_layer.png",
                "abs_dp_by_position.png",
                "log_ratio_hist.png",
            ]
        )
        assert numbers["verdict"]["summary"] in (out / "report.md").read_text()


@pytest.mark.sglang
def test_report_numbers_match_a_direct_computation(reports):
    out, numbers = reports[1]
    arrays = np.load(out / "per_token.npz")
    for name, s in numbers["settings"].items():
        m = arrays[f"{name}/mask"]
        logp, mu = arrays[f"{name}/logp"][m], arrays[f"{name}/mu"][m]
        log_rho = logp - mu  # second formula, written out here: KL(mu||pi) estimators over mu's samples
        assert s["kl_k1"] == pytest.approx(np.mean(mu - logp), abs=1e-6)
        assert s["kl_k3"] == pytest.approx(np.mean(np.exp(log_rho) - log_rho - 1), abs=1e-7)
        assert s["ppl_ratio"] == pytest.approx(np.exp(-logp.mean()) / np.exp(-mu.mean()), rel=1e-5)
        assert s["prob_abs_diff_max"] == pytest.approx(np.abs(np.exp(logp) - np.exp(mu)).max(), abs=1e-7)
        assert s["prob_pearson"] == pytest.approx(np.corrcoef(np.exp(logp), np.exp(mu))[0, 1], abs=1e-5)


@pytest.mark.sglang
def test_r3_drives_the_dispatched_flip_rate_to_zero(reports):
    for _, numbers in reports:
        s = numbers["settings"]
        assert s["r3"]["dispatched_flip_rate"] == 0.0 and s["r3_ksm"]["dispatched_flip_rate"] == 0.0
        assert s["natural"]["dispatched_flip_rate"] == s["natural"]["flip_rate"]


@pytest.mark.sglang
def test_fp8_rollout_weights_increase_the_gap(reports):
    (_, bf16), (_, fp8) = reports
    b, f = bf16["settings"]["natural"], fp8["settings"]["natural"]
    print(
        f"\nbf16 rollout: kl_k3={b['kl_k3']:.3g} flip={b['flip_rate']:.3g}; "
        f"fp8_e4m3 rollout: kl_k3={f['kl_k3']:.3g} flip={f['flip_rate']:.3g}"
    )
    assert f["kl_k3"] > 2 * b["kl_k3"]
    assert f["flip_rate"] > b["flip_rate"]
    assert f["prob_abs_diff_max"] > b["prob_abs_diff_max"]


def _numbers(**natural):
    base = {
        "kl_k1": 0.001,
        "kl_k3": 0.001,
        "chi2_token": 0.01,
        "chi2_seq": 0.01,
        "ess": 0.99,
        "ppl_ratio": 1.0,
        "prob_pearson": 0.999,
        "tokens_with_flip": 0.0,
    }
    nat = base | natural
    return {
        "settings": {"natural": nat, "r3": base, "ksm": base, "r3_ksm": base},
        "rollout": {"dtype": "bfloat16", "weight_quantization": "none"},
        "learner": {"params_dtype": "float32"},
        "ksm_outside_mask_tokens": 0,
    }


@pytest.mark.parametrize(
    ("natural", "causes", "advice_fragment"),
    [
        ({}, [], None),
        ({"prob_pearson": 0.9}, ["A"], "Cause A"),
        ({"kl_k1": 0.08, "ppl_ratio": 1.08}, ["A"], "align precisions"),
        ({"tokens_with_flip": 0.2, "kl_k3": 0.01}, [], "replay.routing: r3"),
    ],
)
def test_verdict_follows_the_decision_tree(natural, causes, advice_fragment):
    v = verdict(_numbers(**natural))
    assert v["causes"] == causes
    if advice_fragment is None:
        assert v["advice"] == [] and v["summary"].startswith("No meaningful drift")
    else:
        assert any(advice_fragment in a for a in v["advice"])


def test_verdict_flags_residual_variance_after_replay():
    numbers = _numbers()
    numbers["settings"]["r3_ksm"] = numbers["settings"]["r3_ksm"] | {"chi2_token": 1.5, "ess": 0.4}
    assert verdict(numbers)["causes"] == ["D"]
    numbers["settings"]["r3_ksm"] |= {"chi2_token": 0.5, "ess": 0.7}
    assert verdict(numbers)["causes"] == ["C"]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("block", [None, 4])
def test_fake_quantize_rounds_to_representable_fp8_values(fmt, block):
    torch.manual_seed(0)
    w = torch.randn(6, 10)
    q = fake_quantize(w, fmt, block)
    assert q.shape == w.shape and q.is_contiguous()
    rel = ((q - w).abs() / w.abs().clamp_min(1e-3)).max()
    mantissa_bits = 3 if fmt == "fp8_e4m3" else 2
    assert 0 < rel <= 2.0**-mantissa_bits  # round-to-nearest: half an ulp of the format, relative
    assert torch.equal(fake_quantize(q, fmt, block), q)  # idempotent on already-quantised values
