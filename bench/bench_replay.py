"""Benchmark the replay layer on CPU: fwd+bwd step time with R3 replay vs natural routing, and
Keep Sampling Mask cost per token.

Run: .venv/bin/python bench/bench_replay.py [--reps 30]
Step times are interleaved (plain, record, replay, replay-without-natural in turn) and
compared by median, by the median of per-round ratios and by the min times, so machine load
drifts affect all variants alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_rl.config import ExperimentConfig
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.model import build_model, forward_logits
from moe_rl.replay.binding import RoutingReplay
from moe_rl.replay.keep_mask import KeptSets, keep_mask_logprobs


def _step(model, ids):
    t0 = time.perf_counter()
    forward_logits(model, ids).float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def bench_step(reps: int, B: int, S: int) -> dict[str, float]:
    cfg = ExperimentConfig()  # the tiny model: 2 layers, hidden 64, 8 experts, top-2
    init_distributed(cfg.parallel, environ={})
    model = build_model(cfg, seed=0)
    replay = RoutingReplay(model)
    L, K, E = replay.num_moe_layers, replay.top_k, replay.num_experts
    ids = torch.randint(0, cfg.model.vocab_size, (B, S))
    routes = torch.argsort(torch.rand(B, S, L, E), dim=-1)[..., :K]

    def plain():
        return _step(model, ids)

    def record():
        with replay.record():
            return _step(model, ids)

    def r3():
        with replay.replay([routes]):
            return _step(model, ids)

    def r3_no_natural():
        with replay.replay([routes], observe_natural=False):
            return _step(model, ids)

    variants = {"plain": plain, "record": record, "r3": r3, "r3_no_natural": r3_no_natural}
    for fn in variants.values():  # warm-up
        for _ in range(3):
            fn()
    times = {k: [] for k in variants}
    for _ in range(reps):
        for k, fn in variants.items():
            times[k].append(fn())
    med = {k: statistics.median(v) for k, v in times.items()}
    # per-round ratios cancel slow drifts of a shared machine; min times show the quiet-machine cost
    paired = statistics.median(a / b for a, b in zip(times["r3"], times["plain"]))
    best = min(times["r3"]) / min(times["plain"])
    return {
        "ratio_r3_over_plain_paired_median": paired,
        "ratio_r3_over_plain_min_times": best,
        "step_ms_plain": 1e3 * med["plain"],
        "step_ms_record": 1e3 * med["record"],
        "step_ms_r3": 1e3 * med["r3"],
        "step_ms_r3_no_natural": 1e3 * med["r3_no_natural"],
        "ratio_r3_over_plain": med["r3"] / med["plain"],
        "ratio_r3_no_natural_over_plain": med["r3_no_natural"] / med["plain"],
        "ratio_record_over_plain": med["record"] / med["plain"],
    }


def bench_keep_mask(N: int, V: int, top_k: int, reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    logits = torch.randn(N, V)
    y = logits.topk(top_k, dim=-1).indices[:, 0]
    kept = logits.topk(top_k, dim=-1).indices
    sets = KeptSets(kept.reshape(-1), torch.arange(0, N * top_k + 1, top_k))

    def timed(fn):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    full = timed(lambda: torch.log_softmax(logits, -1).gather(1, y[:, None]))
    ksm = timed(lambda: keep_mask_logprobs(logits, y, sets, temperature=0.8))
    return {
        "ksm_us_per_token": 1e6 * ksm / N,
        "full_logsoftmax_us_per_token": 1e6 * full / N,
        "ksm_over_full": ksm / full,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    step = bench_step(args.reps, args.batch, args.seq)
    print(f"fwd+bwd tiny model B={args.batch} S={args.seq} (median of {args.reps}, interleaved):")
    for k, v in step.items():
        print(f"  {k:36s} {v:.4f}")
    ksm = bench_keep_mask(N=1024, V=32768, top_k=50, reps=10)
    print("Keep Sampling Mask, N=1024 tokens, V=32768, top-k 50 kept sets:")
    for k, v in ksm.items():
        print(f"  {k:36s} {v:.4f}")


if __name__ == "__main__":
    main()
