"""torchrun worker (2 ranks; gloo on CPU, one GPU per rank with nccl): replay under expert parallel (ep=2) and pipeline parallel (pp=2).

ep=2: each rank replays its own tokens' routes. pp=2: each stage takes its own MoE layers out of
the whole model's routes. Exits non-zero (assertion) if a dispatched routing map differs from
the routes given; prints one "OK" line per check.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import dataclasses

from megatron.core.models.gpt import GPTModel

from moe_rl.config import ExperimentConfig
from moe_rl.learner.cpu_shims import seed_model_parallel_rng
from moe_rl.learner.dist import destroy_distributed, init_distributed
from moe_rl.learner.model import _layer_spec, build_model, forward_logits, transformer_config_from
from moe_rl.replay.binding import RoutingReplay
from tests.conftest import rank_device
from tests.replay.routing_probe import RoutingMapProbe, expected_map, random_routes

E, K, L = 8, 2, 2


def check(dispatcher: str, rank: int) -> None:
    cfg = ExperimentConfig(
        model={
            "num_layers": L,
            "hidden_size": 32,
            "ffn_hidden_size": 64,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "kv_channels": 8,
            "vocab_size": 128,
            "seq_length": 32,
            "num_moe_experts": E,
            "moe_router_topk": K,
            "moe_ffn_hidden_size": 16,
            "moe_token_dispatcher_type": dispatcher,
        },
        parallel={"ep": 2},
    )
    model = build_model(cfg, seed=0)
    replay = RoutingReplay(model)
    probe = RoutingMapProbe(model)
    # each EP rank holds different samples (EP ranks are data-parallel ranks) and different routes
    routes = [random_routes(2, 6, L, K, E, seed=100 * rank + m, device=rank_device()) for m in range(2)]
    ids = torch.randint(0, 128, (2, 2, 6), generator=torch.Generator().manual_seed(rank))
    with replay.replay(routes):
        for m in range(2):
            forward_logits(model, ids[m]).float().pow(2).mean().backward()
    for layer in range(L):
        for m in range(2):
            assert torch.equal(probe.maps[layer][m], expected_map(routes[m], layer, E)), (
                f"rank {rank} layer {layer} mb {m}"
            )
    local_experts = [p for n, p in model.named_parameters() if "local_experts" in n]
    assert local_experts and all(p.grad is not None for p in local_experts), f"rank {rank}: expert grads missing"
    print(f"rank {rank} {dispatcher}: OK", flush=True)


def build_pp_stage(cfg):
    """This rank's pipeline stage's decoder layers with the embedding and output layer on both ranks
    (``build_model`` gives only the first stage the embedding), so each stage runs its layers locally,
    without the pipeline schedule's p2p; ``tests/train/pp_worker.py`` runs the real schedule."""

    one_stage = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"pp": 1})})
    tcfg = dataclasses.replace(
        transformer_config_from(one_stage), pipeline_model_parallel_size=2, pipeline_dtype=torch.float32
    )
    seed_model_parallel_rng(0)
    stage = GPTModel(
        config=tcfg,
        transformer_layer_spec=_layer_spec(tcfg, False),
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    return stage.to(rank_device())


def check_pp(rank: int) -> None:
    # 4 decoder layers, layer 2 dense: MoE layers (global ids 0, 1, 2) are decoder layers 1, 3, 4;
    # stage 0 holds decoder layers 1-2 (MoE id 0), stage 1 holds 3-4 (MoE ids 1, 2).
    cfg = ExperimentConfig(
        model={
            "num_layers": 4,
            "hidden_size": 32,
            "ffn_hidden_size": 64,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "kv_channels": 8,
            "vocab_size": 128,
            "seq_length": 32,
            "num_moe_experts": E,
            "moe_router_topk": K,
            "moe_ffn_hidden_size": 16,
            "moe_token_dispatcher_type": "allgather",
            "moe_layer_freq": [1, 0, 1, 1],
        },
        parallel={"pp": 2},
    )
    init_distributed(cfg.parallel)
    model = build_pp_stage(cfg)
    replay = RoutingReplay(model)
    expect_ids = [[0], [1, 2]][rank]
    assert replay.moe_layer_ids == expect_ids, f"stage {rank}: MoE layer ids {replay.moe_layer_ids} != {expect_ids}"
    probe = RoutingMapProbe(model)
    routes = random_routes(2, 6, 3, K, E, seed=7, device=rank_device())  # the same whole-model routes on both stages
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    # each stage runs its own layers locally (no p2p needed to check which routes reach which router)
    with replay.replay([routes]), torch.no_grad():
        forward_logits(model, ids)
    for local, decoder_idx in enumerate(sorted(probe.maps)):
        got = probe.maps[decoder_idx][0]
        assert torch.equal(got, expected_map(routes, expect_ids[local], E)), f"stage {rank} router {local}"
    print(f"rank {rank} pp: OK", flush=True)


def main() -> None:
    env = init_distributed(ExperimentConfig(parallel={"ep": 2}).parallel)
    for dispatcher in ("allgather", "alltoall"):  # two models in one process, each bound on its own
        check(dispatcher, env.rank)
    check_pp(env.rank)
    destroy_distributed()


if __name__ == "__main__":
    main()
