"""Rollout throughput of the real SGLang CPU server: generated tokens/s with and without routes + masks.

Starts one server for a tiny random Qwen3-MoE (written here), then times batches of concurrent
requests in two modes: plain (log-probs only) and full (log-probs + routed experts + sampling masks,
decoded into RolloutSample records). Prints one line per mode and repeat, then the medians.

  .venv/bin/python bench/bench_rollout.py [--concurrency 16] [--new-tokens 64] [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from moe_rl.config import ModelConfig
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.records import RouteSpec
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.launcher import ServerSpec, SGLangServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()

    model_cfg = ModelConfig(num_layers=2, vocab_size=512)
    spec = RouteSpec.from_model_config(model_cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 512, size=32).tolist() for _ in range(args.concurrency)]
    # ignore_eos is not used: a random model rarely emits EOS; the count below uses what came back.
    sampling = SamplingSettings(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=args.new_tokens)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_hf_checkpoint(model_cfg, Path(tmp) / "model", seed=0)
        t0 = time.perf_counter()
        server_spec = ServerSpec(
            str(model_dir), dtype=args.dtype, deterministic=args.deterministic, mem_fraction_static=0.3
        )
        with SGLangServer(server_spec, Path(tmp) / "server.log") as server:
            startup = time.perf_counter() - t0
            print(f"server healthy after {startup:.1f} s ({args.dtype}, deterministic={args.deterministic})")
            clients = {
                "plain (logprobs)": RolloutClient(
                    [server.url], None, 512, sampling, return_sampling_mask=False, max_concurrency=args.concurrency
                ),
                "routes+masks": RolloutClient([server.url], spec, 512, sampling, max_concurrency=args.concurrency),
            }
            for client in clients.values():  # warm-up: torch.compile of the seeded sampler, batch shapes
                client.generate(prompts, n=1, step=10_000)
            results: dict[str, list[float]] = {name: [] for name in clients}
            for rep in range(args.repeats):
                for name, client in clients.items():
                    t = time.perf_counter()
                    samples = client.generate(prompts, n=1, step=rep)
                    dt = time.perf_counter() - t
                    tokens = sum(len(s.response_ids) for s in samples)
                    results[name].append(tokens / dt)
                    print(
                        f"{name:18s} rep {rep}: {len(samples)} requests, {tokens} tokens in {dt:.2f} s "
                        f"= {tokens / dt:.0f} tok/s"
                    )
    for name, values in results.items():
        print(
            f"median {name:18s}: {statistics.median(values):.0f} generated tok/s "
            f"(min {min(values):.0f}, max {max(values):.0f}; {args.concurrency} concurrent)"
        )


if __name__ == "__main__":
    main()
