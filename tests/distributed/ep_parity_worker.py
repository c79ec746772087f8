"""torchrun worker (2 ranks, gloo): expert parallel ep=2 vs ep=1, and vocab-parallel log-probs at tp=2.

Run: ``torchrun --nproc_per_node=2 --master_port=<free> tests/distributed/ep_parity_worker.py
--hf-dir <tiny HF dir> --out <result.json>``. Rank 0 writes the JSON the pytest
wrapper (``test_expert_parallel.py``) asserts on. Both layouts see the same
weights (imported from the HF dir) and each rank the same data shard, so they
differ only in where the experts live and how tokens reach them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

from moe_rl.config import ExperimentConfig, ParallelConfig  # noqa: E402
from moe_rl.learner.dist import init_distributed  # noqa: E402
from moe_rl.learner.hf_convert import full_megatron_state_dict, load_hf_weights  # noqa: E402
from moe_rl.learner.logprobs import logprobs_from_logits  # noqa: E402
from moe_rl.learner.model import build_model  # noqa: E402
from moe_rl.learner.train_step import Learner  # noqa: E402

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
             num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, ffn_hidden_size=96,
             vocab_size=256, first_k_dense_layers=0, moe_aux_loss_coeff=1e-2, init_method_std=0.1)


def nll(logp, entropy, mb):
    mask = (mb["targets"] >= 0).float()
    return -(logp * mask).sum() / mask.sum(), {}


def run(hf_dir: str, ep: int, dispatcher: str, rank: int) -> dict:
    cfg = ExperimentConfig.model_validate({
        "model": {**MODEL, "moe_token_dispatcher_type": dispatcher},
        "parallel": {"ep": ep}, "optim": {"lr": 1e-3, "clip_grad": 0.0}, "train": {"seed": 3},
    })
    init_distributed(cfg.parallel)
    model = build_model(cfg)
    load_hf_weights(model, hf_dir, cfg.model)
    learner = Learner(cfg, total_steps=1, model=model)
    g = torch.Generator().manual_seed(100 + rank)  # this rank's data shard, same for every layout
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=g)
    stats = learner.train_step([{"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}], nll)
    grads = full_megatron_state_dict(learner.model, grads=True)
    loss = torch.tensor([stats.loss], dtype=torch.float64)
    losses = [torch.zeros_like(loss) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss)
    return {"losses": [float(x) for x in losses], "grad_norm": stats.grad_norm, "grads": grads}


def vocab_parallel_check(rank: int) -> dict:
    """tp=2: each rank holds half the vocab; log-probs, entropy and grads must match the full softmax."""
    init_distributed(ParallelConfig(tp=2))
    g = torch.Generator().manual_seed(7)
    full = (torch.randn(3, 5, 40, generator=g) * 4).double()
    targets = torch.randint(0, 40, (3, 5), generator=g)
    targets[0, 0] = -1
    shard = full[..., rank * 20:(rank + 1) * 20].float().clone().requires_grad_(True)
    logp, ent = logprobs_from_logits(shard, targets, temperature=0.7)
    (logp.sum() + ent.sum()).backward()
    ref_full = full.clone().requires_grad_(True)
    lsm = torch.log_softmax(ref_full / 0.7, -1)
    ref_logp = torch.where(targets >= 0, lsm.gather(-1, targets.clamp_min(0)[..., None])[..., 0], 0.0)
    ref_ent = -(lsm.exp() * lsm).sum(-1)
    (ref_logp.sum() + ref_ent.sum()).backward()
    ref_grad = ref_full.grad[..., rank * 20:(rank + 1) * 20]
    return {
        "logp_max_diff": float((logp.detach().double() - ref_logp.detach()).abs().max()),
        "entropy_max_diff": float((ent.detach().double() - ref_ent.detach()).abs().max()),
        "grad_max_diff": float((shard.grad.double() - ref_grad).abs().max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(ParallelConfig())
    rank = dist.get_rank()
    result: dict = {"dispatchers": {}}
    for dispatcher in ("allgather", "alltoall"):
        ref = run(args.hf_dir, 1, dispatcher, rank)
        got = run(args.hf_dir, 2, dispatcher, rank)
        diffs = {n: float((got["grads"][n] - ref["grads"][n]).abs().max()) for n in ref["grads"]}
        result["dispatchers"][dispatcher] = {
            "ep1_losses": ref["losses"], "ep2_losses": got["losses"],
            "ep1_grad_norm": ref["grad_norm"], "ep2_grad_norm": got["grad_norm"],
            "grad_names_match": sorted(ref["grads"]) == sorted(got["grads"]),
            "num_grads": len(diffs),
            "grad_max_abs_diff": max(diffs.values()),
            "worst_grad": max(diffs, key=diffs.get),
            "max_abs_grad": max(float(t.abs().max()) for t in ref["grads"].values()),
        }
    result["vocab_parallel_tp2"] = vocab_parallel_check(rank)
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
