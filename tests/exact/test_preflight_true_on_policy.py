"""Preflight of ``rollout.true_on_policy``: each setting that cannot be exact is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.preflight import config_problems
from tests.exact.conftest import GLM4_LAYOUT

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
OK = ["rollout.true_on_policy=true", "rollout.dtype=float32", "replay.keep_sampling_mask=false"]


def test_the_gate_settings_pass():
    assert config_problems(load_config(TINY, OK)).problems == []
    assert config_problems(load_config(TINY, [*OK, "parallel.ep=2"])).problems == []
    assert config_problems(load_config(TINY, [*OK, "parallel.pp=2"])).problems == []  # stages run the same kernels
    bf16 = ["rollout.dtype=bfloat16", "precision.params_dtype=bfloat16"]
    assert config_problems(load_config(TINY, [*OK, *bf16, "rollout.weight_sync=disk"])).problems == []


def test_tiny_as_shipped_with_keep_sampling_mask_and_its_truncating_sampler_passes():
    """KSM on with top-p 0.95 / top-k 20 (tiny_cpu as shipped): both sides renormalise over the kept set with
    one kernel (``kernels.kept_token_logprobs``), so the preflight no longer refuses it."""
    cfg = load_config(TINY, ["rollout.true_on_policy=true", "rollout.dtype=float32"])
    assert cfg.ksm_active and cfg.rollout.top_p < 1 and cfg.rollout.top_k == 20
    assert config_problems(cfg).problems == []


@pytest.mark.parametrize(
    "override, named",
    [
        ("rollout.dtype=bfloat16", "rollout.dtype='bfloat16' with precision.params_dtype='float32'"),
        ("rollout.deterministic=false", "rollout.deterministic=false"),
        ("rollout.weight_quantization=fp8_e4m3", "rollout.weight_quantization='fp8_e4m3'"),
        ("parallel.tp=2", "parallel.tp=2"),
        ("model.moe_expert_capacity_factor=1.0", "model.moe_expert_capacity_factor=1.0"),
        ("parallel.etp=2", "parallel.etp=2"),
        ("rollout.device=cuda", "rollout.device='cuda'"),
    ],
)
def test_each_inexact_setting_is_refused_by_name(override, named):
    problems = config_problems(load_config(TINY, [*OK, "replay.routing=none", override])).problems
    assert any(p.startswith(named) and "cannot be exact under rollout.true_on_policy" in p for p in problems), problems


def test_the_deepseek_v3_style_layout_and_pre_softmax_routers_pass():
    """Sigmoid + expert bias + grouped top-k + scaling + shared expert + q/k/v bias + partial RoPE (a tiny
    GLM-4.5) and a pre-softmax Qwen3 router are made exact by the shared kernels: nothing refused."""
    assert config_problems(load_config(TINY, [*OK, *GLM4_LAYOUT, "parallel.ep=2"])).problems == []
    assert config_problems(load_config(TINY, [*OK, "model.moe_router_pre_softmax=true"])).problems == []


def test_the_mode_off_refuses_nothing_new():
    assert (
        config_problems(load_config(TINY, ["rollout.dtype=bfloat16", "replay.keep_sampling_mask=true"])).problems == []
    )
