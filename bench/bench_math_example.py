"""`make math-example`'s figures: held-out pass@1 before RL and at the end, and the wall time.

Builds the example model from nothing in a temp dir (``scripts/make_math_example.py model``: BPE
tokenizer, random-init tiny Qwen3-MoE, the short SFT on the train split), then runs
``moe-rl train configs/math_cpu.yaml`` on it as a user does (a subprocess). Prints one JSON line with
the build and RL wall seconds, every evaluation's ``eval/test/pass@1`` and ``pass@4`` (step 0 is
before the first RL step), the load averages before and after (the machine is often shared: compare
timings only at equal load), and a last line ``math_pass1_gain=<pass@1 at the end - before>``.
Issue 23's goal: +0.10 within 10 minutes on 2 idle cores.

  .venv/bin/python bench/bench_math_example.py [a.b=value ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_math_") as tmp:
        model, out = Path(tmp) / "model", Path(tmp) / "run"
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, str(ROOT / "scripts/make_math_example.py"), "model", "--out", str(model)],
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
        t1 = time.perf_counter()
        cmd = [
            sys.executable,
            "-m",
            "moe_rl.cli",
            "train",
            str(ROOT / "configs/math_cpu.yaml"),
            f"model.hf_path={model}",
            f"train.output_dir={out}",
            "logging.progress=false",
            *overrides,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        t2 = time.perf_counter()
        if proc.returncode:
            sys.exit(f"moe-rl train failed:\n{proc.stderr[-3000:]}")
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        evals = [
            {"step": m["step"], "pass@1": m["eval/test/pass@1"], "pass@4": m.get("eval/test/pass@4")}
            for m in lines
            if "eval/test/pass@1" in m
        ]
        rewards = [m["reward/mean"] for m in lines if "reward/mean" in m]
        truncated = [m["response/truncated_frac"] for m in lines if "response/truncated_frac" in m]
    result = {
        "build_s": round(t1 - t0, 1),
        "rl_s": round(t2 - t1, 1),
        "rl_steps": len(rewards),
        "evals": evals,
        "reward_first3": sum(rewards[:3]) / 3,
        "reward_last3": sum(rewards[-3:]) / 3,
        "truncated_first3": sum(truncated[:3]) / 3,
        "truncated_last3": sum(truncated[-3:]) / 3,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    print(json.dumps(result))
    print(f"math_pass1_gain={evals[-1]['pass@1'] - evals[0]['pass@1']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
