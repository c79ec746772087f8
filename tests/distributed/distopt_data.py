"""Shared by ``distopt_worker.py`` (2 ranks) and ``test_distributed_optimizer.py`` (1 rank): config, data, loss."""

from __future__ import annotations

import torch

from moe_rl.config import ExperimentConfig

MODEL = {
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
    "first_k_dense_layers": 0,
    "moe_aux_loss_coeff": 0.0,
    "init_method_std": 0.1,
}


def cfg(ep: int = 1, distopt: bool = False, clip_grad: float = 1.0):
    return ExperimentConfig.model_validate(
        {
            "model": {**MODEL, "moe_token_dispatcher_type": "alltoall"},
            "parallel": {"ep": ep},
            "optim": {"lr": 1e-3, "clip_grad": clip_grad, "weight_decay": 0.01, "use_distributed_optimizer": distopt},
            "train": {"seed": 3},
        }
    )


def data_shard(rank: int, step: int) -> dict:
    """Rank ``rank``'s microbatch of step ``step`` (the 1-rank run trains on both ranks' as two microbatches)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, MODEL["vocab_size"], (2, 33), generator=g)
    return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}


def nll(logp, entropy, mb):
    mask = (mb["targets"] >= 0).float()
    return -(logp * mask).sum() / mask.sum(), {}
