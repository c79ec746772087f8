"""`configs/agent_cpu.yaml`'s band: held-out success of the multi-turn tool example before and after RL, per seed,
with the lookup tool and without it.

Builds the example model once (``scripts/make_agent_example.py model``: BPE tokenizer with the tool-calling chat
template, random-init tiny Qwen3-MoE, the short SFT on tool-call traces; or ``--model DIR`` reuses one), then for
each seed runs ``moe-rl train configs/agent_cpu.yaml train.seed=S rollout.seed=S`` twice as a user does (a
subprocess, one at a time): with the tool, and the same model, steps and seed with ``rollout.tools=[]`` (a call
gets an ``unknown tool`` error back: the model can only guess). The held-out success is ``eval/test/pass@1``
(the same agent loop on 64 of the 200 boxes never trained on, 2 samples each): step 0 is the SFT start, the
last eval is after RL. Writes a JSON (``--json``, default ``runs/bench_agent_example.json``) with every run's
evals (pass@1, turns and tool calls per trajectory), train reward first / last three steps, wall seconds and the
load averages, and prints one line per run and a last line
``agent_band: tool start->end per seed | no tool start->end per seed``.

  OMP_NUM_THREADS=1 .venv/bin/python bench/bench_agent_example.py [--seeds 1234 1 2] [--model DIR] [a.b=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASS = "eval/test/pass@1"


def build_model(out: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_agent_example.py"), "model", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        sys.exit(f"make_agent_example.py model failed:\n{proc.stderr[-3000:]}")
    print(proc.stdout.strip().splitlines()[-2], flush=True)
    return time.perf_counter() - t0


def run(model: Path, out: Path, seed: int, tools: bool, overrides: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        str(ROOT / "configs/agent_cpu.yaml"),
        f"model.hf_path={model}",
        f"train.output_dir={out}",
        f"train.seed={seed}",
        f"rollout.seed={seed}",
        "logging.progress=false",
        *([] if tools else ["rollout.tools=[]"]),
        *overrides,
    ]
    load, t0 = os.getloadavg(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"moe-rl train failed (seed {seed}, tools={tools}):\n{proc.stderr[-3000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [
        {
            "step": m["step"],
            "pass@1": m[PASS],
            "turns_mean": m.get("eval/test/turns_mean"),
            "tool_calls_mean": m.get("eval/test/tool_calls_mean"),
        }
        for m in lines
        if PASS in m
    ]
    rewards = [m["reward/mean"] for m in lines if "reward/mean" in m]
    return {
        "seed": seed,
        "tools": tools,
        "wall_s": round(wall, 1),
        "rl_steps": len(rewards),
        "evals": evals,
        "start": evals[0]["pass@1"],
        "end": evals[-1]["pass@1"],
        "reward_first3": sum(rewards[:3]) / 3,
        "reward_last3": sum(rewards[-3:]) / 3,
        "load_before": load,
        "load_after": os.getloadavg(),
    }


def write_json(path: Path, result: dict) -> None:
    """After every run, atomically: a bench cut short keeps the runs it finished."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    ap.add_argument("--model", type=Path, default=None, help="a built example model (default: build one)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the runs without tools")
    ap.add_argument("--json", type=Path, default=ROOT / "runs/bench_agent_example.json")
    ap.add_argument("overrides", nargs="*", help="a.b=value overrides of configs/agent_cpu.yaml")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_agent_") as tmp:
        model, build_s = args.model, 0.0
        if model is None:
            model = Path(tmp) / "model"
            build_s = build_model(model)
        runs = []
        order = [(s, True) for s in args.seeds] + ([] if args.no_baseline else [(s, False) for s in args.seeds])
        for seed, tools in order:  # every seed with the tool first: a bench cut short has the band
            r = run(model, Path(tmp) / f"run_{seed}_{'tool' if tools else 'notool'}", seed, tools, args.overrides)
            print(
                f"seed {seed} {'tool   ' if tools else 'no tool'}: held-out pass@1 {r['start']:.3f} -> "
                f"{r['end']:.3f}, tool calls/trajectory {r['evals'][0]['tool_calls_mean']:.2f} -> "
                f"{r['evals'][-1]['tool_calls_mean']:.2f}, {r['wall_s']:.0f} s",
                flush=True,
            )
            runs.append(r)
            write_json(args.json, {"build_s": round(build_s, 1), "overrides": args.overrides, "runs": runs})
    band = {t: ", ".join(f"{r['start']:.3f}->{r['end']:.3f}" for r in runs if r["tools"] == t) for t in (True, False)}
    print(f"agent_band: tool {band[True]} | no tool {band[False] or '-'}  ({args.json})")


if __name__ == "__main__":
    main()
