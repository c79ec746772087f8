"""The memory plan against the real Megatron-Core learner at one rank: tiny, mid-size and the CPU twins.

Each model is built by the learner (GPTModel, Megatron DDP, the optimizer it uses here), takes one
optimizer step, and its parameter elements, weight bytes, DDP grad-buffer bytes and optimizer-state
tensor bytes are counted from the objects themselves; the 2-rank layouts are in
tests/distributed/test_memory_plan_ranks.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.config.memory_plan import rank_memory
from moe_rl.learner.optimizer import is_expert_param
from tests.learner.conftest import make_cfg
from tests.learner.stepped_state import stepped_learner

REPO = Path(__file__).resolve().parents[2]
ONE_RANK = [
    "parallel.tp=1",
    "parallel.ep=1",
    "parallel.pp=1",
    "parallel.etp=null",
    "optim.use_distributed_optimizer=false",
    "optim.optimizer_cpu_offload=false",
    "optim.use_precision_aware_optimizer=false",
]
CONFIGS = {
    "tiny": lambda: make_cfg(),
    "midsize": lambda: load_config(REPO / "configs" / "cpu_midsize.yaml", ONE_RANK),
    **{
        f"twin_{n}": (lambda n=n: load_config(REPO / "configs" / "cpu" / f"{n}.yaml", ONE_RANK))
        for n in ("qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3_style")
    },
}


def measured(cfg) -> dict:
    learner, params, state = stepped_learner(cfg)
    bufs = [*learner.model.buffers, *learner.model.expert_parallel_buffers]
    return {
        "params": sum(p.numel() for p in params),
        "expert": sum(p.numel() for p in params if is_expert_param(p)),
        "weights": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in bufs),
        "optimizer": sum(t.numel() * t.element_size() for t in state),
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_equals_the_built_models_bytes(megatron_world, name):
    cfg = CONFIGS[name]()
    real = measured(cfg)
    plan = rank_memory(cfg, world=1, stage=0)
    assert plan.dense_params + plan.expert_params == real["params"] and plan.expert_params == real["expert"] == 0
    assert plan.weights == real["weights"] and plan.grads == real["grads"]
    assert plan.optimizer == real["optimizer"]
