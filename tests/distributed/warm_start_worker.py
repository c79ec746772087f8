"""2-rank worker (torchrun, gloo): the warm-start cache with a node-local ``cache_dir`` per rank.

Pass 1 builds a complete cache in one shared directory. Then only rank 0's own directory holds it (a copy)
and rank 1's is empty, as with ``~/.cache`` on two nodes: both ranks must agree to train (a split decision
hangs: one rank in the SFT collectives, the other past them). Pass 3: both caches complete, both load.
Writes ``[{rank, passes: [cached, ...], files: [...]}]`` to ``--out`` (rank 0, gathered).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.config import load_config
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.train_step import Learner
from moe_rl.train.warm_start import apply_warm_start, cache_path

REPO = Path(__file__).resolve().parents[2]


def cfg_for(cache_dir: Path):
    return load_config(
        REPO / "configs/demo.yaml",
        ["train.warm_start.steps=2", "train.warm_start.batch_size=4", f"train.warm_start.cache_dir={cache_dir}"],
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    root = Path(args.root)
    torch.set_num_threads(1)
    init_distributed(cfg_for(root / "shared").parallel)
    rank = dist.get_rank()
    passes = []
    # 1. one shared directory: a complete cache for both ranks
    passes.append(apply_warm_start(Learner(cfg_for(root / "shared")), cfg_for(root / "shared"))["cached"])
    own = root / f"node{rank}"
    if rank == 0:  # only "node 0" has it (a copy of the complete cache, as a local ~/.cache would)
        shutil.copytree(cache_path(cfg_for(root / "shared")), cache_path(cfg_for(own)))
    dist.barrier()
    # 2. per-rank directories, the cache on rank 0's only: every rank must train
    passes.append(apply_warm_start(Learner(cfg_for(own)), cfg_for(own))["cached"])
    # 3. now each directory is complete for its rank: every rank loads
    passes.append(apply_warm_start(Learner(cfg_for(own)), cfg_for(own))["cached"])
    files = sorted(p.name for p in cache_path(cfg_for(own)).iterdir())
    reports = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object({"rank": rank, "passes": passes, "files": files}, reports, dst=0)
    if rank == 0:
        Path(args.out).write_text(json.dumps(reports))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
