"""The memory plan (moe_rl.config.memory_plan): sizes from outside the code, the refusal, the printed lines.

Expected values come from sources independent of the estimator: the Qwen3 model cards' parameter counts
(Qwen3-30B-A3B: 30.5B total, 3.3B activated; Qwen3-235B-A22B: 235B total, 22B activated) and issue 34's
sizing of the shipped layouts (~146 / ~93 GB per GPU for the 235B layout without / with the distributed
optimizer, ~231 / ~203 GB for the DeepSeek-style layout on 64 GPUs). The per-rank byte counts are checked
against real Megatron models in tests/learner/test_memory_plan_real.py and tests/distributed/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.cli import main
from moe_rl.config import load_config
from moe_rl.config.memory_plan import GB, local_params, memory_plan
from moe_rl.preflight import config_problems

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
Q30, Q235, DSV3 = (CONFIGS / f"{n}.yaml" for n in ("qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3_style"))
PLAIN = [
    "optim.use_distributed_optimizer=false",
    "optim.optimizer_cpu_offload=false",
    "optim.use_precision_aware_optimizer=false",
]
DSV3_ON_64 = ["parallel.ep=64", "launch.learner_nodes=8"]  # the layout the DeepSeek-style config shipped with


@pytest.mark.parametrize("path, total, active", [(Q30, 30.5e9, 3.3e9), (Q235, 235e9, 22e9)])
def test_parameter_count_matches_the_model_card(path, total, active):
    cfg = load_config(path, ["parallel.tp=1", "parallel.pp=1", "parallel.ep=2", "parallel.etp=1"])
    p, m = local_params(cfg, 0), cfg.model
    assert p.dense + 2 * p.expert == pytest.approx(total, rel=0.005)
    assert p.dense + 2 * p.expert * m.moe_router_topk / m.num_moe_experts == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize(
    "path, overrides, gb",
    [
        (Q235, PLAIN, 146),
        (Q235, [*PLAIN, "optim.use_distributed_optimizer=true"], 93),
        (DSV3, [*PLAIN, *DSV3_ON_64], 231),
        (DSV3, [*PLAIN, *DSV3_ON_64, "optim.use_distributed_optimizer=true"], 203),
    ],
)
def test_state_per_gpu_matches_the_issues_sizing(path, overrides, gb):
    assert memory_plan(load_config(path, overrides)).worst.state / GB == pytest.approx(gb, rel=0.015)


def test_235b_without_the_distributed_optimizer_is_refused_with_numbers_and_fixes():
    problems = config_problems(load_config(Q235, PLAIN)).problems
    (msg,) = [p for p in problems if p.startswith("launch.gpu_memory_gb")]
    assert "146.1 GB per GPU" in msg and "weights 16.2 + gradients 32.5 + optimizer 97.4 GB" in msg
    assert "optim.use_distributed_optimizer=true gives 92.8 GB (not enough)" in msg
    assert "optim.optimizer_cpu_offload=true" in msg and "launch.learner_nodes" in msg


def test_deepseek_style_on_64_gpus_is_refused_even_with_everything_offloaded():
    cfg = load_config(DSV3, DSV3_ON_64)  # the shipped optimizer settings, the old layout
    state = memory_plan(cfg).worst.state
    assert state / GB == pytest.approx(77.6, abs=0.1)  # bf16 weights + fp32 grads of 12.9B local params
    assert not any("state alone" in p for p in config_problems(cfg).problems)  # the state alone fits ...
    assert memory_plan(cfg).worst.total > 80 * GB  # ... but not with the activations: hence ep 128 on 16 nodes
    (total,) = [p for p in config_problems(cfg).problems if p.startswith("launch.gpu_memory_gb=80")]
    assert "the fullest GPU needs" in total  # the job plan's GPU total refuses it (moe_rl.sizing)
    refused = config_problems(load_config(DSV3, [*DSV3_ON_64, "launch.gpu_memory_gb=70"])).problems
    assert any(p.startswith("launch.gpu_memory_gb=70: the learner state alone needs 77.6 GB") for p in refused)


@pytest.mark.parametrize("path", [Q30, Q235, DSV3], ids=lambda p: p.stem)
def test_shipped_cluster_configs_fit_80_gb_with_activations(path):
    plan = memory_plan(load_config(path))
    assert plan.gpu_memory_gb == 80 and plan.worst.total < 80 * GB


def test_offload_and_precision_aware_need_the_distributed_optimizer():
    cfg = load_config(
        Q30,
        [
            "optim.use_distributed_optimizer=false",
            "optim.optimizer_cpu_offload=true",
            "optim.use_precision_aware_optimizer=true",
        ],
    )
    problems = config_problems(cfg).problems
    assert any(p.startswith("optim.use_precision_aware_optimizer=true needs optim.use_distributed") for p in problems)
    assert any(p.startswith("optim.optimizer_cpu_offload=true needs optim.use_distributed") for p in problems)


def test_validate_and_launch_dry_run_print_the_plan(capsys, monkeypatch):
    assert main(["config", "validate", str(Q235)]) == 0
    out = capsys.readouterr().out
    for line in ("weights", "gradients", "optimizer state", "activations", "per node (8 GPUs)"):
        assert line in out
    assert "100% offloaded to the host" in out and "expert dp 2" in out
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-12]")
    assert main(["launch", str(Q235), "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert "# memory plan per GPU (64 learner ranks from launch.learner_nodes*launch.gpus_per_node" in script
    (total,) = [line for line in script.splitlines() if line.startswith("#   state total")]
    assert total.split() == ["#", "state", "total", "48.7", "GB", "of", "launch.gpu_memory_gb=80"]
