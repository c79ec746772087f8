"""torchrun worker (2 ranks; gloo on CPU, one GPU per rank with nccl): a real ``Learner`` with pp=2.

4 MoE decoder layers, 2 per stage (global MoE ids 0, 1 on stage 0; 2, 3 on stage 1), trained through
Megatron's 1F1B schedule (``Learner.train_step`` / ``forward_logprobs``). Checks, one "OK" line each:

- ``unbound``: R3 with MoE layer 3's router left out of stage 1's binding: the rollout-vs-dispatched
  flips show on layer 3 only, and both stages log the same per-layer metrics for all 4 layers;
- ``r2``: R2 records each stage's own layers in the old-log-prob pass and replays them in the update:
  no flip on any layer, exactly-once consumption checked by the binding; the same forwards with Σ_v π_v²
  (``forward_logprobs(..., both=True)``) give the last stage's log-probs and Σπ² on both stages;
- ``expert_bias``: each stage's routers move their expert bias by the valid tokens they dispatched;
- ``export``: the HF checkpoint exported from pp=2 (both stages' layers, global numbers) equals the one
  the same weights give with pp=1 (rank 0 compares; also equal to the imported checkpoint).

Each stage's per-rank HF import (issue 52) is also reported, as ``hf_import_pp2_rank<r>.json`` next to the HF dir.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe_rl.config import ExperimentConfig
from moe_rl.learner.dist import destroy_distributed, init_distributed
from moe_rl.learner.hf_convert import export_hf_state_dict, read_hf_state_dict
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.learner.model import build_model
from moe_rl.learner.train_step import (
    Learner,
    default_logprob_fn,
)
from moe_rl.replay.dispatch_probe import DispatchProbe
from moe_rl.replay.driver import MicrobatchRoutes, ReplayDriver
from moe_rl.train.logprob import make_logprob_fn
from tests.conftest import rank_device
from tests.learner.hf_import_check import check_rank_import
from tests.replay.routing_probe import random_routes

E, K, L, V = 8, 2, 4, 128


def config(pp: int, hf_dir: str) -> ExperimentConfig:
    return ExperimentConfig(
        model={
            "num_layers": L,
            "hidden_size": 32,
            "ffn_hidden_size": 64,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "kv_channels": 8,
            "vocab_size": V,
            "seq_length": 32,
            "num_moe_experts": E,
            "moe_router_topk": K,
            "moe_ffn_hidden_size": 16,
            "moe_token_dispatcher_type": "alltoall",
        },
        parallel={"pp": pp},
        checkpoint={"init_from_hf": hf_dir},
        train={"steps": 1},
    )


def microbatches(n: int, device):
    """``n`` ragged microbatches (B=2; T 6 and 5 alternating) and their routes."""
    g = torch.Generator().manual_seed(1)
    mbs, routes = [], []
    for i in range(n):
        T = 6 - i % 2
        ids = torch.randint(0, V, (2, T + 1), generator=g)
        mbs.append({"input_ids": ids[:, :-1].to(device), "targets": ids[:, 1:].to(device)})
        valid = torch.ones(2, T, dtype=torch.bool)
        routes.append(MicrobatchRoutes([2 * i, 2 * i + 1], valid, random_routes(2, T, L, K, E, seed=10 + i)))
    return mbs, routes


def loss_fn(logp, entropy, mb):
    return -logp.mean(), {"logp": logp.detach().mean()}


def check_unbound(learner, rank: int) -> None:
    driver = ReplayDriver(learner.module, "r3")
    assert driver.layer_ids == [[0, 1], [2, 3]][rank], driver.layer_ids
    if rank == 1:  # leave MoE layer 3's router out of stage 1's binding: it keeps routing naturally
        replay = driver.replay
        replay.layers.pop(1).reset()
        replay.moe_layer_ids.pop(1)
        replay._routers.pop(1)
    mbs, routes = microbatches(3, rank_device())
    with driver.update_pass(routes):
        learner.train_step(mbs, loss_fn)
    m = driver.step_metrics()
    rates = [m[f"replay/rollout_vs_dispatched/response/flip_rate/layer{lid}"] for lid in range(L)]
    assert rates[:3] == [0.0, 0.0, 0.0] and rates[3] > 0.5, f"stage {rank}: per-layer dispatched flip rates {rates}"
    both = [None, None]
    dist.all_gather_object(both, m)
    assert both[0] == both[1], "the two stages log different replay metrics"
    driver.close()
    print(f"rank {rank} unbound: OK {rates}", flush=True)


def check_r2(learner, rank: int) -> None:
    driver = ReplayDriver(learner.module, "r2")
    mbs, routes = microbatches(3, rank_device())
    learner.model.eval()
    with torch.no_grad(), driver.old_logprob_pass(routes):
        old = learner.forward_logprobs(mbs, lambda m, mb, t: _default(m, mb, t), 1.0)
    assert len(old) == 3 and all(o.shape == mb["targets"].shape for o, mb in zip(old, mbs))
    assert all(rec.shape[1] == 2 for rec in driver._r2_records.values()), "R2 records are not this stage's 2 layers"
    with torch.no_grad():  # Σ_v π_v² beside the log-probs (the token baselines' pass): from the last stage, on both
        fn = make_logprob_fn(False, with_entropy=False, sum_pi_squared=True)
        pairs = learner.forward_logprobs(mbs, fn, 1.0, both=True)
    assert all(torch.equal(lp, o) for (lp, _), o in zip(pairs, old)), "the Σπ² pass gives other log-probs"
    spp = torch.cat([sq[mb["targets"] >= 0] for (_, sq), mb in zip(pairs, mbs)])
    assert bool(((spp > 0) & (spp <= 1)).all()), spp
    both = [None, None]
    dist.all_gather_object(both, spp.cpu())
    assert torch.equal(both[0], both[1]), "the two stages hold different Σπ²"
    with driver.update_pass(routes):
        learner.train_step(mbs, loss_fn)
    m = driver.step_metrics()
    rates = [m[f"replay/r2_vs_dispatched/response/flip_rate/layer{lid}"] for lid in range(L)]
    assert rates == [0.0] * L, f"stage {rank}: R2 replay flips {rates}"
    driver.close()
    print(f"rank {rank} r2: OK", flush=True)


def check_expert_bias(rank: int) -> None:
    """DeepSeek-V3's expert bias under pp: ``finalize_model_grads`` after the schedule updates each stage's
    routers from the valid tokens its own layers dispatched (bias += rate * sign(mean count - count))."""

    cfg = config(2, "")
    cfg = cfg.model_copy(
        update={
            "model": cfg.model.model_copy(
                update={"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
            ),
            "checkpoint": cfg.checkpoint.model_copy(update={"init_from_hf": None}),
        }
    )
    learner = Learner(cfg)
    routers = [m for m in learner.module.modules() if getattr(m, "expert_bias", None) is not None]
    assert len(routers) == 2, f"stage {rank}: {len(routers)} routers with an expert bias; expected its 2"
    before = [r.expert_bias.detach().clone() for r in routers]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (3, 12), generator=g).to(rank_device())
    valid = torch.ones(3, 12, dtype=torch.bool, device=rank_device())
    valid[0, 3:] = False
    targets = torch.where(valid, torch.roll(ids, -1, 1), torch.full_like(ids, -1))
    probe = DispatchProbe(learner.module)
    with probe.capture() as cap:
        learner.train_step(
            [{"input_ids": ids, "targets": targets, "padding_mask": ~valid}],
            lambda logp, ent, t: (-(logp * valid).sum() / valid.sum(), {}),
            1.0,
            make_logprob_fn(False, with_entropy=False),
        )
    maps = cap.maps(0)
    probe.close()
    for layer, (router, old) in enumerate(zip(routers, before)):
        counts = maps[..., layer, :][valid.cpu()].sum(0).float()
        expected = 1e-3 * torch.sign(counts.mean() - counts)
        moved = router.expert_bias.detach().cpu() - old.cpu()
        torch.testing.assert_close(moved, expected, msg=f"stage {rank} layer {layer}: not the valid-token rule")
        assert moved.abs().sum() > 0, f"stage {rank} layer {layer}: the expert bias did not move"
    print(f"rank {rank} expert_bias: OK", flush=True)


def _default(model, mb, temperature):
    return default_logprob_fn(model, mb, temperature)


def export(pp: int, hf_dir: str):
    init_distributed(config(pp, hf_dir).parallel)
    learner = Learner(config(pp, hf_dir))
    state = export_hf_state_dict(learner.model, learner.cfg.model)
    return learner, state


def main() -> None:
    hf_dir = sys.argv[1]  # an empty dir for the initial HF checkpoint
    init_distributed(config(2, hf_dir).parallel)
    rank = dist.get_rank()
    if rank == 0:
        write_random_hf_checkpoint(config(2, hf_dir).model, hf_dir, seed=0)
    dist.barrier()
    learner, pp2 = export(2, hf_dir)
    report = check_rank_import(build_model(config(2, hf_dir)), hf_dir, config(2, hf_dir).model)
    (Path(hf_dir).parent / f"hf_import_pp2_rank{rank}.json").write_text(json.dumps(report))
    check_r2(learner, rank)
    check_unbound(learner, rank)  # last: the router it leaves out stays adopted by the closed binding
    check_expert_bias(rank)
    _, pp1 = export(1, hf_dir)  # the same weights on 2 data-parallel ranks, one stage each
    if rank == 0:
        source = read_hf_state_dict(hf_dir)
        assert sorted(pp2) == sorted(pp1) == sorted(source), sorted(set(pp1) ^ set(pp2))
        bad = [k for k in pp1 if not (torch.equal(pp1[k], pp2[k]) and torch.equal(pp1[k], source[k]))]
        assert not bad, f"pp=2 export differs from pp=1 in {bad[:5]}"
        print(f"rank 0 export: OK ({len(pp2)} tensors)", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
