"""torchrun worker (2 ranks, gloo): the rollout-vs-dispatched comparison under sequence parallel.

Megatron's model-parallel groups are built with tp=2 (over gloo, GPUs hidden, so a one-GPU machine runs
it in ``make gpu-check`` as well), so the counts are summed over the real
tensor-parallel group. Every rank holds the same full routes ``[B, S, L, K]``; what its routers
"dispatched" is built from the shard the binding replays with (``sequence_parallel_shard`` of the
Megatron layout), turned into bool maps. In the ``flip`` case rank 1's layer 1 dispatches another expert
set at the first two positions of its block. Rank 0 writes both summaries as JSON to ``--out``.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

if __name__ == "__main__":  # as torchrun's worker only: the test imports inputs() from here, and a GPU hidden
    # at import would hide it from the whole pytest session (make gpu-check saw 0 GPUs in every later test)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the comparison is host-side: gloo ranks on any machine

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe_rl.learner.dist import init_distributed
from moe_rl.replay.driver import DispatchShard, add_flip_counts
from moe_rl.replay.layout import from_megatron_layout, sequence_parallel_shard, to_megatron_layout
from moe_rl.replay.metrics import routes_vs_map_flips

B, S, L, K, E = 3, 8, 3, 2, 8


def inputs():
    g = torch.Generator().manual_seed(0)
    routes = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * S * L)]).view(B, S, L, K)
    lengths, prompts = torch.tensor([8, 5, 7]), torch.tensor([3, 2, 4])  # ragged samples, padded to S
    pos = torch.arange(S)[None, :]
    return routes, pos < lengths[:, None], (pos >= prompts[:, None] - 1) & (pos < lengths[:, None])


def summary(shard: DispatchShard, flip: bool) -> dict:
    routes, valid, response = inputs()
    local = from_megatron_layout(sequence_parallel_shard(to_megatron_layout(routes), B, 2, shard.tp_rank), B)
    maps = torch.zeros(*local.shape[:-1], E, dtype=torch.bool).scatter_(-1, local, True)
    if flip and shard.tp_rank == 1:
        maps[:, :2, 1] = ~maps[:, :2, 1]  # layer 1, first two positions of rank 1's block: another set
    counters: dict = {}
    flips = routes_vs_map_flips(shard.positions(routes), maps)
    add_flip_counts(
        counters, "rollout_vs_dispatched", list(range(L)), shard.positions(valid), shard.positions(response), flips
    )
    out = {}
    for key in sorted(counters):
        for group in shard.groups():
            counters[key].all_reduce(group)
        out.update(counters[key].summary() | {f"{key}/tokens": counters[key].tokens})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(SimpleNamespace(tp=2, pp=1, ep=1, cp=1, etp=None, backend="gloo"))
    tcfg = SimpleNamespace(sequence_parallel=True, tensor_model_parallel_size=2, context_parallel_size=1)
    shard = DispatchShard.of(tcfg)
    out = {case: summary(shard, flip) for case, flip in (("clean", False), ("flip", True))}
    if shard.tp_rank == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
