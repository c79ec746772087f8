"""torchrun worker (2 ranks, gloo): Megatron's distributed optimizer against the plain step, and its checkpoints.

Run: ``torchrun --nproc_per_node=2 --master_port=<free> tests/distributed/distopt_worker.py --work <dir>``
with ``<dir>/init`` (a 1-rank checkpoint of the initial weights) and ``<dir>/dp1`` (the 1-rank run after
step 1 on both ranks' data) written by the pytest side (``test_distributed_optimizer.py``). Every learner
here starts from ``init`` (ep=1 and ep=2 builds draw different expert values). Rank 0 writes
``<dir>/result.json``; the step-2 checkpoints it leaves are resumed at 1 rank by the pytest side.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

from moe_rl.config import ParallelConfig
from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.global_state import optimizer_slots
from moe_rl.learner.train_step import Learner
from tests.distributed.distopt_data import cfg, data_shard, nll
from tests.distributed.offload_layouts import LAYOUTS, gpu_stand_ins, offload_cfg, offload_learner


def learner(work: Path, ep: int, distopt: bool, start: str = "init") -> Learner:
    c = cfg(ep=ep, distopt=distopt)
    init_distributed(c.parallel)
    out = Learner(c, total_steps=4)
    load_checkpoint(out, work / start)
    return out


def step(lrn: Learner, rank: int, s: int) -> dict:
    stats = lrn.train_step([data_shard(rank, s)], nll)
    losses = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(losses, torch.tensor([stats.loss], dtype=torch.float64))
    return {"loss": sum(float(x) for x in losses) / 2, "grad_norm": stats.grad_norm}


def params(lrn: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lrn.module.named_parameters()}


def all_ranks(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t)


def damaged_own_file_on_rank1(lrn: Learner, ckpt: Path, rank: int) -> dict:
    """Issue 57: steps 1 and 2 saved, 4 bytes of rank 1's model file of step 2 flipped (by rank 1), loaded on
    both ranks: every rank's loaded step and the warnings each rank logged."""
    for s in (1, 2):
        save_checkpoint(lrn, ckpt, step=s, run_id="run0000000d2")
    if rank == 1:
        victim = ckpt / "step_00000002" / "model-r00001.safetensors"
        data = bytearray(victim.read_bytes())
        data[-40:-36] = bytes(b ^ 0xFF for b in data[-40:-36])
        victim.write_bytes(bytes(data))
    dist.barrier()
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("moe_rl.learner.checkpoint").addHandler(handler)
    meta = load_checkpoint(Learner(cfg(ep=2, distopt=True), total_steps=4), ckpt)
    logging.getLogger("moe_rl.learner.checkpoint").removeHandler(handler)
    steps, warnings = [None, None], [None, None]
    dist.all_gather_object(steps, meta["step"])
    dist.all_gather_object(warnings, seen)
    return {"steps": steps, "warnings": warnings}


def offload_precision_aware(work: Path, rank: int) -> dict:
    """Issue 52: the 235B/DeepSeek optimizer layout (offload + precision-aware, GPU stand-ins) at dp=2: step 1,
    saved, step 2; a fresh learner resumed from the save, its step 2 (params compared on every rank)."""
    init_distributed(offload_cfg(LAYOUTS["offload+precision_aware"]).parallel)  # ep=1 after the ep=2 learners
    with gpu_stand_ins(torch.device("cpu")):
        a = offload_learner(LAYOUTS["offload+precision_aware"])
        step(a, rank, 1)
        save_checkpoint(a, work / "ckpt_offload_pa")
        out = {"offload_pa_step2": step(a, rank, 2)}
        b = offload_learner(LAYOUTS["offload+precision_aware"], seed=11)
        load_checkpoint(b, work / "ckpt_offload_pa")
        out["offload_pa_resumed"] = step(b, rank, 2)
    pa, pb = params(a), params(b)
    out["offload_pa_resumed_params_bitwise"] = all_ranks(all(torch.equal(pa[n], pb[n]) for n in pa))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    work = Path(ap.parse_args().work)
    init_distributed(ParallelConfig())
    rank, res = dist.get_rank(), {}

    plain, distopt = learner(work, 1, False), learner(work, 1, True)
    res["plain_step1"], res["distopt_step1"] = step(plain, rank, 1), step(distopt, rank, 1)
    a, b = params(plain), params(distopt)
    res["step1_params_bitwise"] = all_ranks(all(torch.equal(a[n], b[n]) for n in a))
    res["step1_params_max_diff"] = max(float((a[n] - b[n]).abs().max()) for n in a)
    # the distributed optimizer keeps this rank's flat shard of each parameter's moments only
    res["moment_elements_this_rank"] = sum(
        s.opt.state[s.main]["exp_avg"].numel() for s in optimizer_slots(distopt.optimizer)
    )
    res["param_elements"] = sum(p.numel() for p in distopt.module.parameters())
    save_checkpoint(plain, work / "ckpt_plain")
    save_checkpoint(distopt, work / "ckpt_distopt")
    res["distopt_step2"] = step(distopt, rank, 2)
    save_checkpoint(distopt, work / "after_distopt")  # the uninterrupted run's state after step 2

    for name, ckpt in (
        ("plain_to_distopt", "ckpt_plain"),
        ("dp1_to_distopt", "dp1"),
        ("distopt_to_distopt", "ckpt_distopt"),
    ):
        resumed = learner(work, 1, True, start=ckpt)
        res[name] = step(resumed, rank, 2)

    ep2 = learner(work, 2, True)  # ep=2 and the distributed optimizer: dense state over dp=2, experts' not sharded
    res["ep2_distopt_step1"] = step(ep2, rank, 1)
    save_checkpoint(ep2, work / "ckpt_ep2_distopt")
    res["ep2_distopt_step2"] = step(ep2, rank, 2)
    res["fallback"] = damaged_own_file_on_rank1(ep2, work / "damaged", rank)
    res.update(offload_precision_aware(work, rank))
    if rank == 0:
        (work / "result.json").write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
