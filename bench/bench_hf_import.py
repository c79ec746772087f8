"""HF import per rank (issue 52): bytes read and anonymous memory added by ``checkpoint.init_from_hf`` at ep=2.

Writes the 306.6M-parameter expert-heavy MoE (6 layers, hidden 256, 64 experts of 1024, fp32; the weight-sync
benchmark's ``300m``) as a sharded HF checkpoint, then runs itself under torchrun with 2 ranks (ep=2). Each rank
builds its model at random, then imports the checkpoint twice, a thread sampling ``RssAnon`` (``/proc/self/status``;
mapped file pages do not count) every millisecond:

* ``per_rank``: ``hf_import.load_hf_weights`` (the trainer's path): bytes from the reader's own counter;
* ``whole_dict``: the previous release (every shard ``load_file``d into one dict, ``hf_to_megatron``, then this
  rank's slice): bytes = every tensor of every file.

Each figure: the peak RssAnon above its value after the random init. Prints one JSON line per rank and
``hf_import_bytes_ratio=`` / ``hf_import_rss_ratio=`` (per-rank / whole-dict, the worse rank).

  python bench/bench_hf_import.py [--keep DIR]   # ~2.5 GB disk for the checkpoint in a temp dir
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_rl.config import ExperimentConfig, ModelConfig
from moe_rl.learner.dist import destroy_distributed, free_port, init_distributed
from moe_rl.learner.hf_convert import hf_to_megatron, read_hf_state_dict
from moe_rl.learner.hf_import import load_hf_weights
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.learner.model import build_model, unwrap
from moe_rl.learner.ownership import global_name, local_expert_range, stage_layer_offset, tp_rank_and_size
from moe_rl.learner.tp_shards import tp_slice

MODEL = ModelConfig(
    num_layers=6, hidden_size=256, num_moe_experts=64, moe_router_topk=2, moe_ffn_hidden_size=1024, vocab_size=8192
)
MiB = 1 << 20


def rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class Peak:
    """RssAnon's peak above its value at entry, sampled every millisecond on a thread."""

    def __enter__(self):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.base, self.peak, self.stop = rss_anon(), 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.increase = max(self.peak, rss_anon()) - self.base


def whole_dict_import(model, hf_dir: str, model_cfg) -> int:
    """The previous release's ``load_hf_weights``; returns the tensor bytes it read (every file, whole)."""
    hf = read_hf_state_dict(hf_dir)
    read = sum(t.numel() * t.element_size() for t in hf.values())
    full = hf_to_megatron(hf, model_cfg)
    start, _ = local_expert_range(model)
    offset = stage_layer_offset(model)
    with torch.no_grad():
        for name, tensor in unwrap(model).state_dict().items():
            src = global_name(name, start, offset)
            if src in full:
                tensor.copy_(tp_slice(src, full[src], *tp_rank_and_size(src)).to(tensor.dtype))
    return read


def worker(hf_dir: str, out: Path) -> None:
    torch.set_num_threads(1)
    cfg = ExperimentConfig(model=MODEL.model_dump(), parallel={"ep": int(os.environ["WORLD_SIZE"])})
    init_distributed(cfg.parallel)
    rank = torch.distributed.get_rank()
    model = build_model(cfg)
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    row = {"rank": rank, "own_param_bytes": own, "rss_anon_after_random_init": rss_anon()}
    with Peak() as peak:
        t0 = time.perf_counter()
        stats = load_hf_weights(model, hf_dir, cfg.model)
        row["per_rank"] = {"seconds": time.perf_counter() - t0, "bytes_read": stats.total_bytes}
    row["per_rank"]["rss_anon_increase"] = peak.increase
    row["per_rank"]["bytes_by_file"] = stats.bytes_by_file
    torch.distributed.barrier()
    with Peak() as peak:
        t0 = time.perf_counter()
        read = whole_dict_import(model, hf_dir, cfg.model)
        row["whole_dict"] = {"seconds": time.perf_counter() - t0, "bytes_read": read}
    row["whole_dict"]["rss_anon_increase"] = peak.increase
    (out / f"rank{rank}.json").write_text(json.dumps(row))
    destroy_distributed()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", help="write the checkpoint here (reused when present) instead of a temp dir")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("HF_DIR", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(args.keep or Path(tmp) / "hf")
        if not (hf / "model.safetensors.index.json").exists():
            t0 = time.perf_counter()
            write_random_hf_checkpoint(MODEL, hf, seed=0, max_shard_size="200MB")
            print(f"wrote {hf} in {time.perf_counter() - t0:.0f} s", flush=True)
        shapes = {n: t.numel() * t.element_size() for n, t in read_hf_state_dict(hf).items()}
        total, largest = sum(shapes.values()), max(shapes.values())
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), f"--nproc_per_node={args.ranks}", f"--master_port={free_port()}", __file__]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        subprocess.run([*cmd, "--worker", str(hf), tmp], check=True, env=env)
        rows = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    params = total // 4
    print(
        f"checkpoint: {params / 1e6:.1f}M parameters, {total / MiB:.0f} MiB of tensors, largest {largest / MiB:.1f} MiB"
    )
    for row in rows:
        row["checkpoint_bytes"], row["largest_tensor_bytes"] = total, largest
        print(json.dumps(row))
        new, old = row["per_rank"], row["whole_dict"]
        print(
            f"rank {row['rank']}: owns {row['own_param_bytes'] / MiB:.0f} MiB; read {new['bytes_read'] / MiB:.0f} MiB "
            f"(whole-dict {old['bytes_read'] / MiB:.0f}); RssAnon +{new['rss_anon_increase'] / MiB:.0f} MiB "
            f"(whole-dict +{old['rss_anon_increase'] / MiB:.0f}); {new['seconds']:.1f} s (whole-dict {old['seconds']:.1f} s)"
        )
    print(f"hf_import_bytes_ratio={max(r['per_rank']['bytes_read'] / r['whole_dict']['bytes_read'] for r in rows):.3f}")
    print(
        "hf_import_rss_ratio="
        f"{max(r['per_rank']['rss_anon_increase'] / r['whole_dict']['rss_anon_increase'] for r in rows):.3f}"
    )


if __name__ == "__main__":
    main()
