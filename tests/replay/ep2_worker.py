"""torchrun worker (2 ranks, gloo, expert_model_parallel_size=2): each rank replays its own tokens' routes.

Exits non-zero (assertion) if any rank's dispatched routing map differs from the routes it was given.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe_rl.config import ExperimentConfig  # noqa: E402
from moe_rl.learner.dist import destroy_distributed, init_distributed  # noqa: E402
from moe_rl.learner.model import build_model, forward_logits  # noqa: E402
from moe_rl.replay.binding import RoutingReplay  # noqa: E402
from tests.replay.routing_probe import RoutingMapProbe, expected_map, random_routes  # noqa: E402

E, K, L = 8, 2, 2


def check(dispatcher: str, rank: int) -> None:
    cfg = ExperimentConfig(
        model=dict(num_layers=L, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   kv_channels=8, vocab_size=128, seq_length=32, num_moe_experts=E, moe_router_topk=K,
                   moe_ffn_hidden_size=16, moe_token_dispatcher_type=dispatcher),
        parallel=dict(ep=2),
    )
    model = build_model(cfg, seed=0)
    replay = RoutingReplay(model)
    probe = RoutingMapProbe(model)
    # each EP rank holds different samples (EP ranks are data-parallel ranks) and different routes
    routes = [random_routes(2, 6, L, K, E, seed=100 * rank + m) for m in range(2)]
    ids = torch.randint(0, 128, (2, 2, 6), generator=torch.Generator().manual_seed(rank))
    with replay.replay(routes):
        for m in range(2):
            forward_logits(model, ids[m]).float().pow(2).mean().backward()
    for l in range(L):
        for m in range(2):
            assert torch.equal(probe.maps[l][m], expected_map(routes[m], l, E)), f"rank {rank} layer {l} mb {m}"
    local_experts = [p for n, p in model.named_parameters() if "local_experts" in n]
    assert local_experts and all(p.grad is not None for p in local_experts), f"rank {rank}: expert grads missing"
    print(f"rank {rank} {dispatcher}: OK", flush=True)


def main() -> None:
    env = init_distributed(ExperimentConfig(parallel=dict(ep=2)).parallel)
    for dispatcher in ("allgather", "alltoall"):  # two models in one process, each bound on its own
        check(dispatcher, env.rank)
    destroy_distributed()


if __name__ == "__main__":
    main()
