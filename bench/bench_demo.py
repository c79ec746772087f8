"""`make demo`'s figures: wall time from a cold warm-start cache, reward first -> last, machine load.

Runs ``moe-rl train configs/demo.yaml`` as a user does (a subprocess), with the warm-start cache
in a fresh temp dir so the supervised phase really runs, and prints one JSON line: wall seconds,
warm-start seconds, mean reward at the first and last RL step, the gain, the step count and the
load averages before and after (the machine is often shared; compare timings only at equal load).
Targets (issue 15): <= 360 s on 2 cores, first reward <= 0.5, gain >= 0.3, last >= 0.8.

  .venv/bin/python bench/bench_demo.py [--config configs/demo.yaml] [a.b=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/demo.yaml"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_demo_") as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "moe_rl.cli", "train", args.config, f"train.output_dir={out}",
               f"train.warm_start.cache_dir={Path(tmp) / 'cache'}", "logging.progress=false", *args.overrides]  # fmt: skip
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"moe-rl train failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        warm = re.search(r"\[warm start\] trained \d+ steps in ([0-9.]+) s", proc.stderr)
        first, last = records[0]["reward/mean"], records[-1]["reward/mean"]
        print(json.dumps({
            "wall_s": round(wall, 1), "warm_start_s": float(warm.group(1)) if warm else None,
            "reward_first": round(first, 4), "reward_last": round(last, 4), "gain": round(last - first, 4),
            "reward_max": round(max(r["reward/mean"] for r in records), 4), "steps": len(records),
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
        }))  # fmt: skip


if __name__ == "__main__":
    main()
