"""The served-weights digests' cost per push (issue 57): SHA-256 of every tensor sent, on this host's CPU.

The same function runs on both sides (``moe_rl.sync.served_weights.tensor_digest`` on the sending learner ranks, SGLang
patch 0014's ``received_digest`` on every server rank as each tensor arrives), so one timing is the cost added to a
push on each side (in sequence within a side; the learner's ranks and the server's ranks hash in parallel). Models:
tiny (configs/tiny_cpu.yaml), cpu_midsize (configs/cpu_midsize.yaml) and the 306M expert-heavy model of
``bench_weight_sync.py`` (``300m``); the HF state dict moe_rl sends (``write_random_hf_checkpoint``: one tensor per
expert projection), random values, in fp32 (the CPU learners' export) and bf16.

  python bench/bench_served_digests.py [--repeats 3] [--models tiny,cpu_midsize,300m]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from moe_rl.config import load_config
from moe_rl.learner.hf_convert import read_hf_state_dict
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.sync.served_weights import tensor_digests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_weight_sync import MODELS  # after the path: the 306M model is defined there

CONFIGS = {
    "tiny": lambda: load_config(ROOT / "configs/tiny_cpu.yaml").model,
    "cpu_midsize": lambda: load_config(ROOT / "configs/cpu_midsize.yaml").model,
    "300m": lambda: MODELS["300m"],
}


def hf_state(model_cfg) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        return read_hf_state_dict(write_random_hf_checkpoint(model_cfg, tmp, seed=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="tiny,cpu_midsize,300m")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    for name in args.models.split(","):
        fp32 = hf_state(CONFIGS[name]())
        for dtype in (torch.float32, torch.bfloat16):
            state = {n: t.to(dtype) for n, t in fp32.items()}
            params = sum(t.numel() for t in state.values())
            mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                tensor_digests(state)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            print(
                f"{name:12s} {str(dtype).removeprefix('torch.'):9s} {params / 1e6:7.1f}M params {len(state):5d} tensors "
                f"{mib:8.1f} MiB: digest {med * 1e3:9.1f} ms per side per push (min {min(times) * 1e3:.1f}), "
                f"{mib / med:7.0f} MiB/s"
            )
            del state


if __name__ == "__main__":
    main()
