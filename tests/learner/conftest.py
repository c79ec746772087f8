"""Learner test fixtures: one gloo world of size 1 with Megatron parallel state, config builders."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import ExperimentConfig
from moe_rl.learner.dist import init_distributed

# Tiny models on a shared 2-core box: intra-op threads only add contention
# (measured 0.03 s vs 0.3-3 s per train step under load).
torch.set_num_threads(1)


def make_cfg(train: dict | None = None, optim: dict | None = None, **model):
    """A small fp32 ``ExperimentConfig`` with ``model`` overrides (Megatron field names)."""

    base = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "kv_channels": 16,
        "num_moe_experts": 8,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 32,
        "ffn_hidden_size": 96,
        "vocab_size": 256,
    }
    base.update(model)
    tree = {"model": base, "train": {"micro_batch_size": 4, "seed": 7, **(train or {})}, "optim": optim or {}}
    return ExperimentConfig.model_validate(tree)


@pytest.fixture(scope="session")
def megatron_world():
    """Default process group (gloo, world 1) + Megatron model-parallel groups, all sizes 1."""

    cfg = make_cfg()
    return init_distributed(cfg.parallel, environ={})
