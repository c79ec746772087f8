"""Replay test fixtures: a gloo world of size 1 and tiny real Megatron-Core MoE models built by the learner."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

from moe_rl.config import ExperimentConfig
from moe_rl.learner.cpu_shims import seed_model_parallel_rng
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.model import _layer_spec, build_model, forward_logits, transformer_config_from
from tests.conftest import session_device


def make_cfg(**model_overrides):
    """ExperimentConfig of a tiny MoE model (3 layers, 8 experts, top-2) with overrides on ``model``."""

    model = {
        "num_layers": 3,
        "hidden_size": 32,
        "ffn_hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "kv_channels": 8,
        "vocab_size": 128,
        "seq_length": 64,
        "num_moe_experts": 8,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 16,
        "moe_token_dispatcher_type": "allgather",
    }
    train = model_overrides.pop("train", {})
    model.update(model_overrides)
    return ExperimentConfig(model=model, train=train)


@pytest.fixture(scope="session")
def megatron_world():
    return init_distributed(make_cfg().parallel, environ={})


@pytest.fixture
def build(megatron_world):
    """``build(seed=0, **model_overrides) -> GPTModel`` (a real Megatron-Core model on CPU)."""

    def _build(seed: int = 0, **overrides):
        return build_model(make_cfg(**overrides), seed=seed)

    return _build


def forward(model, input_ids: torch.Tensor) -> torch.Tensor:
    return forward_logits(model, input_ids)


def compose_model(seed: int = 0, mtp: bool = False, **tcfg_overrides):
    """A tiny GPTModel from the learner's TransformerConfig with Megatron fields the learner does not
    expose yet (MTP layers, selective / block recompute) replaced; composed from Megatron's own specs."""

    cfg = make_cfg()
    if mtp:
        tcfg_overrides["mtp_num_layers"] = 1
    tcfg = dataclasses.replace(transformer_config_from(cfg), **tcfg_overrides)
    seed_model_parallel_rng(seed)
    spec = _layer_spec(tcfg, False)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        mtp_block_spec=get_gpt_mtp_block_spec(tcfg, spec, use_transformer_engine=False) if mtp else None,
    )
    return model.to(session_device())


@pytest.fixture
def compose(megatron_world):
    """``compose(seed=0, mtp=False, **TransformerConfig overrides) -> GPTModel``."""
    return compose_model
