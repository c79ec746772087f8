"""Sync vs async rollouts on the demo's model and task, with the learner and the server on their own cores.

The disaggregated layout in miniature: every ``moe-rl train`` run is pinned to ``--learner-cpus`` (the
process and so its torch threads) and launches its SGLang server on ``--server-cpus``
(``rollout.server_cpus``), in sync mode and in async mode alike, so the ratio measures the overlap of
generation and training, not the pinning. Runs are interleaved (sync, async, sync, async, …) so drift in
the machine's load hits both modes. Each run is ``--steps`` RL steps of ``configs/demo.yaml`` (its cached
warm start; the first run builds the cache). Per run one JSON line:

* ``rl_wall_s``: the sum of the steps' ``time/step_s`` (rollout or waiting for it, old log-probs,
  updates, weight sync: the RL loop, without server start-up, warm start and checkpoints);
* ``learner_idle_frac``: the learner's share of that time spent waiting for rollouts (sync:
  ``time/rollout_s``; async: ``time/learner_wait_s``);
* ``server_idle_frac``: the share the server generated nothing (sync: ``1 - rollout_s / step_s``; async:
  the producer's ``time/rollout_idle_s``: waiting for admission or for a weight push);
* ``gen_tokens_per_s``: response tokens generated per second of generating (the steps' tokens over the time the
  rollout side was not idle: sync ``time/rollout_s``, async the RL-loop time less ``time/rollout_idle_s``);
* ``reward_first`` / ``reward_last``: the mean reward of the first and last step.

With ``--partial`` a third mode runs too, ``partial``: async with ``rollout.partial=true`` (a weight push
pauses the batch in flight with ``rollout.pause_mode`` and continues it under the new weights instead
of waiting for it; issue 29), reported as ``partial_speedup=<sync / partial>`` and per run the share of
samples spanning two versions. The last line is ``async_speedup=<sum of sync rl_wall_s / sum of async
rl_wall_s>`` over the repeats; before it ``bound=`` (the issue's (G + T) / max(G, T), G the sync runs' generation time,
T the rest), ``pipelined_bound=`` (``pipelined_s``: what one-step-ahead pipelining of the same sync steps could
reach, the first batch and the last update overlapping nothing) and per mode the speedup as a share of each.
Before the runs, ``core_interference=<x>``: how much slower the server's core
computes while the learner's core computes too (1.0: independent cores, what the bound assumes).

The runs keep ``rollout.max_concurrency=16`` (``--max-concurrency``), the client concurrency every figure of issue 36
was measured at; ``configs/demo.yaml`` itself sets 128 since 2026-11-27 (the same samples, generated ~2x faster).

  .venv/bin/python bench/bench_async.py [--steps 12] [--repeats 2] [--learner-cpus 0] [--server-cpus 1] \
      [--staleness 1] [--partial] [--max-concurrency 16] [a.b=value ...]
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

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_once(mode: str, args, overrides: list[str]) -> dict:
    learner = {int(c) for c in args.learner_cpus.split(",")}
    partial = ["rollout.partial=true"] if mode == "partial" else []
    with tempfile.TemporaryDirectory(prefix=f"bench_async_{mode}_") as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "moe_rl.cli",
            "train",
            args.config,
            f"train.output_dir={out}",
            f"train.steps={args.steps}",
            f"train.rollout_mode={'sync' if mode == 'sync' else 'async'}",
            f"train.max_staleness={args.staleness}",
            f"rollout.server_cpus=[{args.server_cpus}]",
            "checkpoint.save_interval=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            f"rollout.max_concurrency={args.max_concurrency}",
            *partial,
            *overrides,
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=ROOT,
            preexec_fn=lambda: os.sched_setaffinity(0, learner),
            check=False,
        )
        wall = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"moe-rl train ({mode}) failed:\n{proc.stderr[-3000:]}")
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        run_cfg = yaml.safe_load((out / "config.yaml").read_text())
    samples = run_cfg["train"]["prompts_per_step"] * run_cfg["rollout"]["samples_per_prompt"]
    tokens = sum(m["response/len_mean"] * samples for m in steps)
    total = sum(m["time/step_s"] for m in steps)
    if mode == "sync":
        learner_idle = sum(m["time/rollout_s"] for m in steps) / total
        server_idle = 1 - learner_idle
    else:
        learner_idle = sum(m["time/learner_wait_s"] for m in steps) / total
        server_idle = sum(m["time/rollout_idle_s"] for m in steps) / total
    generating_s = total * (1 - server_idle)  # the time the rollout side was making batches
    if mode == "sync":  # per step: generation and the rest (what the async bounds are computed from)
        gen = [m["time/rollout_s"] for m in steps]
        rest = [m["time/step_s"] - g for m, g in zip(steps, gen)]
        per_step = {"gen_s": [round(g, 3) for g in gen], "rest_s": [round(t, 3) for t in rest]}
    else:
        per_step = {}
    return {
        "mode": mode,
        "steps": len(steps),
        "rl_wall_s": round(total, 2),
        "process_wall_s": round(wall, 1),
        "learner_idle_frac": round(learner_idle, 3),
        "server_idle_frac": round(server_idle, 3),
        "gen_tokens_per_s": round(tokens / max(generating_s, 1e-9), 1),
        "partial_frac": round(sum(m.get("async/partial_frac", 0.0) for m in steps) / len(steps), 3),
        "staleness_mean": round(sum(m.get("async/staleness_mean", 0.0) for m in steps) / len(steps), 3),
        "reward_first": round(steps[0]["reward/mean"], 4),
        "reward_last": round(steps[-1]["reward/mean"], 4),
        "first_step_s": round(steps[0]["time/step_s"], 2),
        "load_after": [round(x, 2) for x in os.getloadavg()],
        **per_step,
    }


def pipelined_s(gen: list[float], rest: list[float]) -> float:
    """The least RL-loop time async mode at ``max_staleness: 1`` can take for sync steps that generated for ``gen[i]``
    and trained, pushed, … for ``rest[i]`` seconds: steps 0 and 1 are made at once on one server, step ``i + 1`` trains
    once pushed, a push waits for the batch in flight, which the next batch follows. So
    ``G0 + sum_i max(T_i, G_{i+1}) + T_last``: the first batch (with the server's first-request warm-up) and the last
    update overlap nothing. The issue's bound ``(G + T) / max(G, T)`` is its limit over many steps."""
    return gen[0] + sum(max(t, g) for t, g in zip(rest[:-1], gen[1:])) + rest[-1]


_PROBE = (
    "import sys, time, torch; torch.set_num_threads(1); a = torch.randn(384, 384); t = time.perf_counter()\n"
    "for _ in range(600): a @ a\n"
    "print(time.perf_counter() - t)"
)


def core_interference(learner: str, server: str, repeats: int = 3) -> float:
    """How much slower a single-threaded matmul loop runs on the server's cores while the learner's cores run one too
    (median of ``repeats``; 1.0 = independent cores). The async bound (G + T) / max(G, T) assumes 1.0: generation
    and training overlap only as well as the cores do."""

    def timed(cpus: str, background: str | None) -> float:
        other = None
        if background is not None:
            other = subprocess.Popen(
                ["taskset", "-c", background, sys.executable, "-c", _PROBE.replace("600", "1200")],
                stdout=subprocess.DEVNULL,
            )
            time.sleep(0.3)
        out = subprocess.run(
            ["taskset", "-c", cpus, sys.executable, "-c", _PROBE], capture_output=True, text=True, check=False
        )
        if other is not None:
            other.kill()
            other.wait()
        return float(out.stdout)

    ratios = sorted(timed(server, learner) / timed(server, None) for _ in range(repeats))
    return ratios[len(ratios) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=1, help="train.max_staleness of the async runs")
    parser.add_argument("--learner-cpus", default="0", help="comma-separated cores of the trainer process")
    parser.add_argument("--server-cpus", default="1", help="comma-separated cores of the SGLang server")
    parser.add_argument("--partial", action="store_true", help="also async with rollout.partial=true")
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=16,
        help="rollout.max_concurrency of every run: 16, the workload issue 36's figures are measured "
        "at (configs/demo.yaml sets 128 since 2026-11-27; docs/benchmarks.md)",
    )
    args, overrides = parser.parse_known_args()
    print(
        json.dumps(
            {
                "cpus": sorted(os.sched_getaffinity(0)),
                "config": args.config,
                "steps": args.steps,
                "learner_cpus": args.learner_cpus,
                "server_cpus": args.server_cpus,
                "max_concurrency": args.max_concurrency,
                "overrides": overrides,
            }
        ),
        flush=True,
    )
    print(f"core_interference={core_interference(args.learner_cpus, args.server_cpus):.2f}", flush=True)
    modes = ("sync", "async", "partial") if args.partial else ("sync", "async")
    walls = dict.fromkeys(modes, 0.0)
    gen_s = pipelined = 0.0
    for _ in range(args.repeats):
        for mode in modes:
            result = run_once(mode, args, overrides)
            walls[mode] += result["rl_wall_s"]
            if mode == "sync":
                gen_s += sum(result["gen_s"])
                pipelined += pipelined_s(result["gen_s"], result["rest_s"])
            print(json.dumps(result), flush=True)
    sync = walls["sync"]
    bound = sync / max(gen_s, sync - gen_s)  # (G + T) / max(G, T) over the sync runs' sums
    k1 = args.staleness == 1  # pipelined_s is the schedule of max_staleness 1
    print(f"bound={bound:.3f}" + (f" pipelined_bound={sync / pipelined:.3f}" if k1 else ""))
    for mode in modes[1:]:
        print(
            f"{mode}: of_bound={sync / walls[mode] / bound:.3f}"
            + (f" of_pipelined_bound={pipelined / walls[mode]:.3f}" if k1 else "")
        )
    if args.partial:
        print(f"partial_speedup={walls['sync'] / walls['partial']:.3f}")
    print(f"async_speedup={walls['sync'] / walls['async']:.3f}")


if __name__ == "__main__":
    main()
