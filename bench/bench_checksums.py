"""What the checkpoint checksums cost (issue 57, item 2): a save with and without hashing, and the verification.

One learner (1 rank, gloo, fp32; the expert-heavy MoE of ``bench_checkpoint`` with fewer experts by default),
one train step so Adam has state; then ``--repeats`` rounds of: ``save_checkpoint`` as shipped (every
written buffer also fed to sha256: one whole-file digest and one per 64 MiB chunk), ``save_checkpoint``
with ``HashingFile`` replaced by a pass-through writer (the same writes, no hashing), and ``verify_save``
of the step dir (what a load adds: one read of every file in 64 MiB chunks, one sha256 per chunk). The
order alternates between rounds; the best and the median of each are reported, as seconds per GB written. Also the bare
``hashlib.sha256`` rate over a 64 MiB buffer on this CPU.

  python bench/bench_checksums.py [--experts 16] [--repeats 3] [--dir SCRATCH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_checkpoint import MODEL

from moe_rl.config import ExperimentConfig
from moe_rl.learner import checksums, sharded_state
from moe_rl.learner.checkpoint import save_checkpoint
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.train_step import Learner


class PlainFile(checksums.HashingFile):
    """The same writes as ``HashingFile``, no digest (the baseline)."""

    def write(self, data) -> None:
        self.fh.write(data)

    def record(self) -> dict:
        return {"bytes": 0, "sha256": "", "chunks": []}


def timed_save(learner, ckpt: Path, hashing: bool) -> float:
    shutil.rmtree(ckpt, ignore_errors=True)
    writer = checksums.HashingFile if hashing else PlainFile
    saved = sharded_state.HashingFile, checksums.HashingFile
    sharded_state.HashingFile = checksums.HashingFile = writer
    try:
        t0 = time.perf_counter()
        save_checkpoint(learner, ckpt, run_id="bench", step=1)
        return time.perf_counter() - t0
    finally:
        sharded_state.HashingFile, checksums.HashingFile = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch dir (default: a temp dir, removed)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench_sums_"))
    cfg = ExperimentConfig.model_validate({"model": MODEL | {"num_moe_experts": args.experts}, "train": {"seed": 1}})
    init_distributed(cfg.parallel, environ={})
    learner = Learner(cfg, total_steps=2)
    tokens = torch.randint(0, MODEL["vocab_size"], (1, 17), generator=torch.Generator().manual_seed(0))
    learner.train_step(
        [{"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}], lambda logp, ent, mb: (-logp.mean(), {})
    )
    ckpt = scratch / "ckpt"
    times = {"hashed": [], "plain": [], "verify": []}
    d = ckpt / "step_00000001"
    for i in range(args.repeats):
        for hashing in (True, False) if i % 2 == 0 else (False, True):
            times["hashed" if hashing else "plain"].append(timed_save(learner, ckpt, hashing))
            if hashing:
                meta = json.loads((d / "meta.json").read_text())
                t0 = time.perf_counter()
                checksums.verify_save(d, meta, 0, 1)
                times["verify"].append(time.perf_counter() - t0)
    gb = sum(f.stat().st_size for f in d.iterdir() if f.is_file()) / 1e9
    buf = os.urandom(64 << 20)
    t0 = time.perf_counter()
    for _ in range(8):
        hashlib.sha256(buf).hexdigest()
    raw = 8 * len(buf) / 1e9 / (time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for p in learner.module.parameters())
    print(f"model {params / 1e6:.1f}M params, checkpoint {gb:.2f} GB, load average {os.getloadavg()[0]:.1f}")
    print(f"sha256 alone: {raw:.2f} GB/s (one core)")
    print(f"save, hashed: {best['hashed']:.2f} s ({best['hashed'] / gb:.2f} s/GB); all: {times['hashed']}")
    print(f"save, plain:  {best['plain']:.2f} s ({best['plain'] / gb:.2f} s/GB); all: {times['plain']}")
    print(
        f"hashing adds {(best['hashed'] - best['plain']) / gb:+.2f} s/GB to a save (best of each), "
        f"{(med['hashed'] - med['plain']) / gb:+.2f} s/GB (medians)"
    )
    print(f"verify (load): {best['verify']:.2f} s ({best['verify'] / gb:.2f} s/GB); all: {times['verify']}")
    if args.dir is None:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
