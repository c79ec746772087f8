"""`make demo`'s figures over seeds: wall time from a cold warm-start cache, reward first -> last, machine load.

Runs ``moe-rl train configs/demo.yaml`` as a user does (a subprocess), each run with the warm-start
cache in a fresh temp dir so the supervised phase really runs. Without ``--seeds`` it is one run
with the config's seeds; ``--seeds N`` runs N times with ``train.seed`` = ``train.warm_start.seed``
= 11, 22, 33, ... (``--seed-list 5,7`` picks them). One JSON line per run: seed, wall seconds,
warm-start seconds, the mean reward of the first three and of the last three RL steps, their
gain, the max, every step's mean reward, and the load averages before and after (the machine is
often shared: compare timings only at equal load). A last line sums up the seeds: the band of
the last-three means, the smallest gain, the slowest wall time, and the targets (issue 26):
last three >= 0.8 and >= first three + 0.3 in every run, <= 360 s on 2 idle cores. The first
line names the machine (CPU model, core and thread counts, torch / sglang / megatron-core
versions): the rewards are bit-for-bit repeatable only on the same such machine.

  .venv/bin/python bench/bench_demo.py [--config configs/demo.yaml] [--seeds 3] [a.b=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run_once(config: str, overrides: list[str], seed: int | None) -> dict:
    """One cold-cache ``moe-rl train`` run; its figures as a dict (exits with stderr's tail on failure)."""
    seeds = [] if seed is None else [f"train.seed={seed}", f"train.warm_start.seed={seed}"]
    with tempfile.TemporaryDirectory(prefix="bench_demo_") as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "moe_rl.cli",
            "train",
            config,
            f"train.output_dir={out}",
            f"train.warm_start.cache_dir={Path(tmp) / 'cache'}",
            "logging.progress=false",
            *seeds,
            *overrides,
        ]
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"moe-rl train (seed {seed}) failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    warm = re.search(r"\[warm start\] trained \d+ steps in ([0-9.]+) s: nll [0-9.]+ -> ([0-9.]+)", proc.stderr)
    rewards = [r["reward/mean"] for r in records]
    first3, last3 = sum(rewards[:3]) / len(rewards[:3]), sum(rewards[-3:]) / len(rewards[-3:])
    return {
        "seed": seed,
        "wall_s": round(wall, 1),
        "warm_start_s": float(warm.group(1)) if warm else None,
        "warm_start_nll": float(warm.group(2)) if warm else None,
        "first3": round(first3, 4),
        "last3": round(last3, 4),
        "gain": round(last3 - first3, 4),
        "reward_first": round(rewards[0], 4),
        "reward_last": round(rewards[-1], 4),
        "reward_max": round(max(rewards), 4),
        "steps": len(rewards),
        "rewards": [round(r, 3) for r in rewards],
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def machine() -> dict:
    """What a run's numbers depend on besides the code and the seeds (docs/demo/README.md, "Deterministic")."""

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    versions = {}
    for pkg in ("torch", "sglang", "megatron-core"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        **versions,
    }


def summary(runs: list[dict]) -> dict:
    last3 = [r["last3"] for r in runs]
    return {
        "seeds": [r["seed"] for r in runs],
        "last3_band": [min(last3), max(last3)],
        "first3_band": [min(r["first3"] for r in runs), max(r["first3"] for r in runs)],
        "min_gain": min(r["gain"] for r in runs),
        "max_wall_s": max(r["wall_s"] for r in runs),
        "every_run_last3_ge_0.8": all(x >= 0.8 for x in last3),
        "every_run_gain_ge_0.3": all(r["gain"] >= 0.3 for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/demo.yaml"))
    ap.add_argument("--seeds", type=int, default=0, help="N runs with seeds 11, 22, 33, ... (0: the config's seeds)")
    ap.add_argument("--seed-list", default=None, help="comma-separated seeds instead of 11, 22, 33, ...")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.seed_list:
        seeds: list[int | None] = [int(s) for s in args.seed_list.split(",")]
    elif args.seeds > 0:
        seeds = [11 * (i + 1) for i in range(args.seeds)]
    else:
        seeds = [None]
    print(json.dumps({"machine": machine()}), flush=True)
    runs = []
    for seed in seeds:
        runs.append(run_once(args.config, args.overrides, seed))
        print(json.dumps(runs[-1]), flush=True)
    if len(runs) > 1:
        print(json.dumps({"summary": summary(runs)}), flush=True)


if __name__ == "__main__":
    main()
