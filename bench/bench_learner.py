"""Learner forward+backward throughput (tokens/s) on the tiny MoE model, ep=1 and ep=2 (CPU, gloo).

Usage: ``python bench/bench_learner.py [--ep 1|2] [--ranks N] [--dispatcher alltoall|allgather]
[--micro-batch 8] [--seq 128] [--iters 20] [--threads 1]``. ``--ep 2`` re-launches
itself under ``torchrun --nproc_per_node=2``. Each rank runs its own microbatch
(data parallel for dense layers, expert parallel for MoE layers), so global
tokens per iteration = ranks x micro-batch x seq. Times forward + backward +
DDP grad sync through the real ``Learner`` model; no optimizer step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.config import ExperimentConfig
from moe_rl.learner.dist import free_port, init_distributed
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.train_step import Learner

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=1, choices=[1, 2])
    ap.add_argument("--ranks", type=int, default=None, help="processes (default: ep); ep=1 ranks=2 is pure DP")
    ap.add_argument("--dispatcher", default="alltoall", choices=["alltoall", "allgather"])
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--master-port", type=int, default=None)
    return ap.parse_args()


def relaunch_under_torchrun(args: argparse.Namespace) -> int:
    port = args.master_port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.ranks or args.ep}",
        f"--master_port={port}",
        __file__,
        *sys.argv[1:],
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)}
    return subprocess.call(cmd, env=env)


def main() -> None:
    args = parse()
    if (args.ranks or args.ep) > 1 and "RANK" not in os.environ:
        sys.exit(relaunch_under_torchrun(args))

    warnings.filterwarnings("ignore")

    torch.set_num_threads(args.threads)

    cfg = ExperimentConfig.model_validate(
        {
            "model": {"moe_token_dispatcher_type": args.dispatcher},
            "parallel": {"ep": args.ep},
            "train": {"micro_batch_size": args.micro_batch},
        }
    )
    init_distributed(cfg.parallel)
    rank, world = dist.get_rank(), dist.get_world_size()
    learner = Learner(cfg, total_steps=1)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (args.micro_batch, args.seq + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def fwd_bwd() -> None:
        learner.model.zero_grad_buffer()
        logp, _ = response_logprobs(learner.model, inputs, targets, with_entropy=False)
        (-logp.mean()).backward()
        learner.model.finish_grad_sync()

    for _ in range(args.warmup):
        fwd_bwd()
    dist.barrier()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        fwd_bwd()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    tokens_per_iter = world * args.micro_batch * args.seq
    if rank == 0:
        m = cfg.model
        print(
            f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_moe_experts} experts top-{m.moe_router_topk}, "
            f"vocab {m.vocab_size}; ranks {world}, ep {args.ep}, dispatcher {args.dispatcher}, "
            f"threads/rank {args.threads}, load avg {os.getloadavg()[0]:.1f}"
        )
        print(
            f"tokens/iter {tokens_per_iter}  median {median * 1e3:.1f} ms  best {times[0] * 1e3:.1f} ms  "
            f"fwd+bwd tokens/s (median) {tokens_per_iter / median:,.0f}  (best) {tokens_per_iter / times[0]:,.0f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
