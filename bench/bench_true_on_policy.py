"""Cost of ``rollout.true_on_policy``: rollout tokens/s and learner time per step, with and without it.

Runs ``moe-rl train CONFIG`` twice (the mode off, then on) with the same seeds and sizes, and prints
the median over the steps after the first of ``rollout/tokens_per_s``, ``time/old_logp_s``,
``time/train_s`` and ``time/step_s`` from each run's ``metrics.jsonl``, plus the mode's exactness
metrics. Both runs use fp32 rollouts, one minibatch per step and no Keep Sampling Mask (the mode's
requirements), so the only difference is the kernels.
Usage: python bench/bench_true_on_policy.py [--config configs/tiny_cpu.yaml --steps 4 --out /tmp/tp_bench]
       python bench/bench_true_on_policy.py --learner-only [--batch 16 --seq 40]   (in-process, no server)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from moe_rl.config.loader import load_config
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.model import build_model

KEYS = ("rollout/tokens_per_s", "time/rollout_s", "time/old_logp_s", "time/train_s", "time/step_s")
EXACT = ("offpolicy/log_ratio_abs_max", "offpolicy/kl_k3", "replay/rollout_vs_natural/response/flip_rate")


def run(config: str, out: Path, steps: int, exact: bool, extra: list[str]) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        config,
        f"train.output_dir={out}",
        f"train.steps={steps}",
        f"rollout.true_on_policy={str(exact).lower()}",
        "rollout.dtype=float32",
        "train.minibatches_per_step=1",
        "replay.keep_sampling_mask=false",
        "replay.routing=none",
        "checkpoint.save_interval=1000",
        "logging.tensorboard=false",
        "logging.progress=false",
        "rollout.startup_timeout_s=900",
        *extra,
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(f"# {'exact' if exact else 'stock'} run: {time.perf_counter() - t0:.0f} s wall", flush=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def learner_only(config: str, batch: int, seq: int, repeats: int = 3) -> None:
    """Median forward and forward+backward time of the learner on one ``[batch, seq]`` microbatch."""

    torch.set_num_threads(1)
    base = load_config(config, ["rollout.dtype=float32", "replay.keep_sampling_mask=false"])
    init_distributed(base.parallel, environ={})
    ids = torch.randint(0, base.model.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    print(f"| learner, one microbatch [{batch}, {seq}] | forward s | forward+backward s |")
    print("|---|---|---|")
    for exact in (False, True):
        cfg = base.model_copy(update={"rollout": base.rollout.model_copy(update={"true_on_policy": exact})})
        model = build_model(cfg)
        fwd, fb = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            with torch.no_grad():
                response_logprobs(model, ids[:, :-1], ids[:, 1:], with_entropy=False)
            fwd.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            logp, _ = response_logprobs(model, ids[:, :-1], ids[:, 1:], with_entropy=False)
            logp.sum().backward()
            fb.append(time.perf_counter() - t0)
        label = "true_on_policy" if exact else "stock kernels"
        print(f"| {label} | {statistics.median(fwd):.3f} | {statistics.median(fb):.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--learner-only", action="store_true")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=40)
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("/tmp/true_on_policy_bench"))
    ap.add_argument("extra", nargs="*", help="more a.b=value overrides for both runs")
    args = ap.parse_args()
    if args.learner_only:
        learner_only(args.config, args.batch, args.seq)
        return
    rows = {}
    for exact in (False, True):
        rows[exact] = run(args.config, args.out / ("exact" if exact else "stock"), args.steps, exact, args.extra)
    print("| metric (median of steps 2..) | stock kernels | true_on_policy | ratio |")
    print("|---|---|---|---|")
    for key in KEYS:
        a, b = (statistics.median(m[key] for m in rows[e][1:]) for e in (False, True))
        print(f"| {key} | {a:.3g} | {b:.3g} | {b / a:.2f}x |")
    for key in EXACT:
        print(
            f"| {key} (max over steps) | {max(m[key] for m in rows[False]):.3g} | "
            f"{max(m[key] for m in rows[True]):.3g} | |"
        )


if __name__ == "__main__":
    main()
