"""Checkpoint save / load of an expert-heavy MoE of ~305M parameters at 1 and 2 ranks (issue 34).

Model (built here, fp32): 6 layers, hidden 256, 64 experts top-2, moe_ffn_hidden_size 1024 (experts
~302M of ~305M parameters). Per layout, every rank: build the learner, one train step on a tiny batch
(so Adam has state), then time ``save_checkpoint`` and ``load_checkpoint`` (into the same learner), and
report the bytes of the files it wrote and the peak increase of its resident memory during the save
(``VmRSS`` from ``/proc/self/status`` sampled every 2 ms by a thread) next to its own state (its
parameters, grad buffer excluded, plus its Adam moments and master copies). At the load (issue 52): the
tensor bytes read (``ShardedDir``'s own counter), the rank's own share (the bytes of the parts it loads), the
bytes of the global tensors those parts come from (what the previous reader, which assembled every global
tensor it touched, read) and the peak ``RssAnon`` increase (mapped file pages excluded; sampled every 1 ms,
after ``malloc_trim``; workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so it follows live memory). ``--code
DIR`` runs the workers on another tree (e.g. the previous release's reader, which has no byte counter).

  python bench/bench_checkpoint.py [--layouts 1,ep2,dp2_distopt] [--dir SCRATCH]

Runs each 2-rank layout under torchrun (gloo) itself; prints one line per rank and a table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.config import ExperimentConfig
from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
from moe_rl.learner.dist import free_port, init_distributed
from moe_rl.learner.global_state import optimizer_slots
from moe_rl.learner.sharded_state import ShardedDir
from moe_rl.learner.train_step import Learner

REPO = Path(__file__).resolve().parents[1]
MODEL = {
    "num_layers": 6,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 64,
    "num_moe_experts": 64,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 1024,
    "ffn_hidden_size": 1024,
    "vocab_size": 1024,
    "first_k_dense_layers": 0,
    "moe_aux_loss_coeff": 0.0,
}
LAYOUTS = {"1": (1, {}, False), "ep2": (2, {"ep": 2}, False), "dp2_distopt": (2, {}, True)}


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_anon() -> int:
    return rss_bytes("RssAnon")


class PeakRSS:
    """Samples this process's resident memory every ``period`` s while active; ``peak`` in bytes."""

    def __init__(self, period: float = 0.002, sample=rss_bytes):
        self.period, self.peak, self._stop, self.sample = period, 0, threading.Event(), sample

    def __enter__(self):
        self.peak = self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            time.sleep(self.period)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())


class PartsRead:
    """Records what ``ShardedDir.part`` hands this rank during a load: its own share (bytes of the parts), the
    bytes of the global tensors they come from (what the previous reader, which assembled each global tensor
    whole, read) and the largest one; the bytes actually read come from the reader's own counter."""

    def __enter__(self):
        self.own = self.global_bytes = self.largest = self.read = 0
        self._part = getattr(ShardedDir, "part", None)
        if self._part is None:  # the previous reader (``--code`` of an older tree): no counter
            return self
        self.start, rec = ShardedDir.process_bytes_read, self

        def part(src, key, s, flat=None):
            out = rec._part(src, key, s, flat)
            whole = math.prod(src.shape(key)) * out.element_size()
            rec.own += out.numel() * out.element_size()
            rec.global_bytes, rec.largest = rec.global_bytes + whole, max(rec.largest, whole)
            return out

        ShardedDir.part = part
        return self

    def __exit__(self, *exc):
        if self._part is not None:
            ShardedDir.part = self._part
            self.read = ShardedDir.process_bytes_read - self.start


def own_state_bytes(learner) -> int:
    n = sum(p.numel() * p.element_size() for p in learner.module.parameters())
    for s in optimizer_slots(learner.optimizer):
        state = s.opt.state.get(s.state_key, {})
        n += sum(t.numel() * t.element_size() for k, t in state.items() if torch.is_tensor(t) and k != "master_param")
        n += s.main.numel() * s.main.element_size() if s.separate_main else 0
    return n


def worker(layout: str, scratch: Path) -> None:
    torch.set_num_threads(1)
    _, parallel, distopt = LAYOUTS[layout]
    cfg = ExperimentConfig.model_validate(
        {"model": MODEL, "parallel": parallel, "train": {"seed": 1}, "optim": {"use_distributed_optimizer": distopt}}
    )
    init_distributed(cfg.parallel)
    rank = dist.get_rank()
    learner = Learner(cfg, total_steps=2)
    tokens = torch.randint(0, MODEL["vocab_size"], (1, 17), generator=torch.Generator().manual_seed(rank))
    learner.train_step(
        [{"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}], lambda logp, ent, mb: (-logp.mean(), {})
    )
    params = sum(p.numel() for p in learner.module.parameters())
    ckpt = scratch / f"ckpt_{layout}"
    dist.barrier()
    with PeakRSS() as mem:
        before = rss_bytes()
        t0 = time.perf_counter()
        d = save_checkpoint(learner, ckpt)
        save_s = time.perf_counter() - t0
    dist.barrier()
    written = sum(
        f.stat().st_size
        for f in d.iterdir()
        if f.is_file() and (f.name.endswith(f"r{rank:05d}.safetensors") or f.name == f"rank_{rank:05d}.safetensors")
    )
    written += (d / "meta.json").stat().st_size if rank == 0 else 0
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with PeakRSS(0.001, rss_anon) as anon, PartsRead() as parts:
        anon_before = rss_anon()
        t0 = time.perf_counter()
        load_checkpoint(learner, ckpt)
        load_s = time.perf_counter() - t0
    dist.barrier()
    out = {
        "layout": layout,
        "rank": rank,
        "local_params": params,
        "save_s": save_s,
        "load_s": load_s,
        "bytes_written": written,
        "own_state_bytes": own_state_bytes(learner),
        "save_peak_rss_increase": mem.peak - before,
        "load_bytes_read": parts.read,
        "load_own_share_bytes": parts.own,
        "load_previous_reader_bytes": parts.global_bytes,
        "largest_tensor_bytes": parts.largest,
        "load_peak_rss_anon_increase": anon.peak - anon_before,
        "load_average": os.getloadavg()[0],
    }
    (scratch / f"{layout}_rank{rank}.json").write_text(json.dumps(out))
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="1,ep2,dp2_distopt")
    ap.add_argument("--dir", default=None, help="scratch dir (default: a temp dir, removed)")
    ap.add_argument("--code", default=str(REPO), help="the moe_rl tree the workers import (an older one: its reader)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, Path(args.dir))

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    rows = []
    for layout in args.layouts.split(","):
        nproc = LAYOUTS[layout][0]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
            __file__,
            "--worker",
            layout,
            "--dir",
            str(scratch),
        ]
        # a fixed mmap threshold: every tensor of 64 KiB or more is mmapped and unmapped when freed, so RssAnon
        # follows live memory, not glibc's retention of freed heap (its threshold otherwise grows to 32 MiB)
        env = {**os.environ, "PYTHONPATH": args.code, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        rows += [json.loads((scratch / f"{layout}_rank{r}.json").read_text()) for r in range(nproc)]
        subprocess.run(["rm", "-rf", str(scratch / f"ckpt_{layout}")], check=True)
    gb = 1e9
    print(
        f"{'layout':<12} {'rank':>4} {'params(M)':>9} {'save s':>7} {'load s':>7} {'written GB':>10} "
        f"{'own state GB':>12} {'save peak RSS +GB':>17} {'load avg':>8}"
    )
    for r in rows:
        print(
            f"{r['layout']:<12} {r['rank']:>4} {r['local_params'] / 1e6:>9.1f} {r['save_s']:>7.1f} {r['load_s']:>7.1f} "
            f"{r['bytes_written'] / gb:>10.2f} {r['own_state_bytes'] / gb:>12.2f} "
            f"{r['save_peak_rss_increase'] / gb:>17.3f} {r['load_average']:>8.1f}"
        )
    mib = 1 << 20
    print(
        f"{'layout':<12} {'rank':>4} {'load read MiB':>13} {'own share MiB':>13} {'previous reader MiB':>19} "
        f"{'largest MiB':>11} {'load peak RssAnon +MiB':>22}"
    )
    for r in rows:
        print(
            f"{r['layout']:<12} {r['rank']:>4} {r['load_bytes_read'] / mib:>13.1f} {r['load_own_share_bytes'] / mib:>13.1f} "
            f"{r['load_previous_reader_bytes'] / mib:>19.1f} {r['largest_tensor_bytes'] / mib:>11.1f} "
            f"{r['load_peak_rss_anon_increase'] / mib:>22.1f}"
        )


if __name__ == "__main__":
    main()
