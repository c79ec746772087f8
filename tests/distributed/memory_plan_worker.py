"""torchrun worker (2 ranks, gloo): what the real Megatron-Core learner holds per rank, for the memory plan.

For two CPU twins at their own layouts (qwen3_30b_a3b: ep=2, dp 2; qwen3_235b_a22b: pp=2; the
deepseek_v3_style twin is measured at one rank by tests/learner/test_memory_plan_real.py)
it builds the learner (model, Megatron DDP, optimizer), runs one optimizer step on constant
gradients and records, per rank: dense and expert parameter elements, weight bytes, the DDP grad
buffers' bytes and the optimizer state's tensor bytes. Then, for the 30B twin (dp 2, expert dp 1),
Megatron DDP with ``use_distributed_optimizer=True`` and Megatron's own
``DistributedOptimizer._build_gbuf_range_map`` give the elements of this rank's optimizer shard.
When the learner builds Megatron's distributed optimizer for ``optim.use_distributed_optimizer=true``
(issue 34's learner change), the same twin's real optimizer state after one step is recorded too.
Nothing here computes an expected value: the test compares these counts with ``memory_plan``.
Writes ``--out`` (JSON: one entry per rank) from every rank (``--out`` gets ``.rank<r>``).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.moe.router_replay import RouterReplay

from moe_rl.config import load_config
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.model import build_model
from moe_rl.learner.optimizer import is_expert_param, megatron_step
from moe_rl.learner.train_step import Learner
from tests.learner.stepped_state import stepped_learner

REPO = Path(__file__).resolve().parents[2]
TWINS = ("qwen3_30b_a3b", "qwen3_235b_a22b")
# Today's learner (before the distributed optimizer lands) builds the non-distributed optimizer: ask for it.
PLAIN_OPTIMIZER = [
    "optim.use_distributed_optimizer=false",
    "optim.optimizer_cpu_offload=false",
    "optim.use_precision_aware_optimizer=false",
]


def twin_cfg(name: str, *overrides: str):
    return load_config(REPO / "configs" / "cpu" / f"{name}.yaml", [*PLAIN_OPTIMIZER, *overrides])


def buffers(ddp) -> list:
    return [*ddp.buffers, *ddp.expert_parallel_buffers]


def measure(cfg) -> dict:
    init_distributed(cfg.parallel)
    learner, params, state = stepped_learner(cfg)
    return {
        "stage": ps.get_pipeline_model_parallel_rank(),
        "dense": sum(p.numel() for p in params if not is_expert_param(p)),
        "expert": sum(p.numel() for p in params if is_expert_param(p)),
        "weight_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers(learner.model)),
        "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
        "dp": ps.get_data_parallel_world_size(),
        "edp": ps.get_expert_data_parallel_world_size(),
    }


def optimizer_state_bytes(optimizer) -> int | None:
    """Tensor bytes of a Megatron (chained / distributed) optimizer's state: Adam moments and fp32 master shards.

    None when ``optimizer`` is not Megatron's DistributedOptimizer (the learner does not build it yet).
    """
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if not all(type(o).__name__ == "DistributedOptimizer" for o in parts):
        return None
    total = 0
    for o in parts:
        inner = o.optimizer
        total += sum(
            t.numel() * t.element_size()
            for s in inner.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        total += sum(t.numel() * t.element_size() for g in o.shard_fp32_from_float16_groups for t in g if t is not None)
    return total


def measure_distributed(cfg) -> dict:
    init_distributed(cfg.parallel)
    RouterReplay.clear_global_router_replay_instances()
    learner = Learner(cfg)
    if optimizer_state_bytes(learner.optimizer) is None:
        return {"built": type(learner.optimizer).__name__}
    for p in learner.model.parameters():
        if p.requires_grad:
            p.main_grad.fill_(1e-3)
    megatron_step(learner.optimizer)  # the learner's own step (Megatron's optimizer under the CPU device context)
    return {"built": "DistributedOptimizer", "optimizer_bytes": optimizer_state_bytes(learner.optimizer)}


def distributed_shard(cfg) -> dict:
    """Elements of this rank's distributed-optimizer shard, dense and expert, by Megatron's own range map."""

    init_distributed(cfg.parallel)
    RouterReplay.clear_global_router_replay_instances()
    model = build_model(cfg)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    ddp = DistributedDataParallel(model.config, ddp_cfg, model)
    out = {}
    for kind, bufs in (("dense", ddp.buffers), ("expert", ddp.expert_parallel_buffers)):
        shard = padded = 0
        for buf in bufs:
            padded += buf.grad_data.numel()
            for bucket_ranges in DistributedOptimizer._build_gbuf_range_map(buf).values():
                for bucket in bucket_ranges:
                    shard += sum(r["param"].size for r in bucket["param_map"].values())
        out[kind] = {"shard": shard, "buffer": padded, "group": bufs[0].data_parallel_group.size() if bufs else 0}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {name: measure(twin_cfg(name)) for name in TWINS}
    report["distributed_shard_30b"] = distributed_shard(twin_cfg("qwen3_30b_a3b"))
    report["distributed_optimizer_30b"] = measure_distributed(
        twin_cfg("qwen3_30b_a3b", "optim.use_distributed_optimizer=true")
    )
    rank = torch.distributed.get_rank()
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(report))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
