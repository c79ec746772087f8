"""Rollout throughput of the real SGLang CPU server: routes + masks vs log-probs only, interleaved.

Starts one server for a tiny random Qwen3-MoE (written here) and times batches of concurrent
requests in two modes, alternating: plain (log-probs only) and full (log-probs + routed experts +
sampling masks, decoded into RolloutSample records). Each pair gives one ratio full/plain; the
reported ratio is the median of the pairs, with its spread. Also reports the bytes on the wire per
(token, layer, slot) of routes and per kept id of masks (decoded payload; base64 size separately),
and the client's route decode throughput (int32-equivalent GB/s) on a Qwen3-30B-A3B-shaped reply.
The last line is `recording_throughput_ratio=<median>`.

  python bench/bench_rollout.py [--concurrency 16] [--new-tokens 64] [--pairs 9] [--dtype float32]
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from moe_rl.config import ModelConfig
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.records import RouteSpec
from moe_rl.records.sglang_meta import decode_routes, wire_payload_sizes
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec

MODEL = ModelConfig(num_layers=2, vocab_size=512)


def make_clients(tmp: Path, concurrency: int, new_tokens: int):
    """(model dir, prompts, url -> {mode: client}) with the frozen benchmark settings."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 512, size=32).tolist() for _ in range(concurrency)]
    # ignore_eos is not used: a random model rarely emits EOS; the count below uses what came back.
    sampling = SamplingSettings(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=new_tokens)
    model_dir = write_random_hf_checkpoint(MODEL, tmp / "model", seed=0)
    spec = RouteSpec.from_model_config(MODEL)

    def clients(url: str) -> dict[str, RolloutClient]:
        return {
            "plain (logprobs)": RolloutClient(
                [url], None, 512, sampling, return_sampling_mask=False, max_concurrency=concurrency
            ),
            "routes+masks": RolloutClient([url], spec, 512, sampling, max_concurrency=concurrency),
        }

    return model_dir, prompts, clients


def wire_report(url: str, client: RolloutClient, prompt: list[int]) -> str:
    """Bytes per route entry and per kept id in one raw reply of `client`'s request."""
    body = client.request_body(prompt, seed=1)
    meta = httpx.post(f"{url}/generate", json=body, timeout=120).json()["meta_info"]
    sizes = wire_payload_sizes(meta, MODEL.num_layers, MODEL.moe_router_topk)
    return (
        f"wire: routes {sizes['route_payload_bytes_per_entry']:.2f} B per (token, layer, slot) decoded "
        f"({sizes['route_dtype']}; base64 {sizes['route_base64_bytes_per_entry']:.2f} B); "
        f"kept ids {sizes['mask_payload_bytes_per_id']:.2f} B per id ({sizes['mask_form']}; "
        f"as sent {sizes['mask_sent_bytes_per_id']:.2f} B per id)"
    )


def route_decode_gbps(dtype: str, tokens: int = 8192, layers: int = 48, top_k: int = 8, experts: int = 128) -> float:
    """Client decode throughput of a Qwen3-30B-A3B-shaped reply, GB/s of int32-equivalent data."""

    rng = np.random.default_rng(0)
    routes = np.argsort(rng.random((tokens, layers, experts), dtype=np.float32), axis=-1)[..., :top_k]
    meta = {"routed_experts": base64.b64encode(routes.astype(dtype).tobytes()).decode()}
    if dtype != "int32":
        meta["routed_experts_dtype"] = dtype
    spec = RouteSpec(num_hidden_layers=layers, moe_layer_ids=tuple(range(layers)), top_k=top_k, num_experts=experts)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        decode_routes(meta, prompt_len=tokens, response_len=1, spec=spec)
        best = min(best, time.perf_counter() - t0)
    return tokens * layers * top_k * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=9, help="interleaved (plain, routes+masks) pairs; >= 7")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    if args.pairs < 7:
        ap.error(f"--pairs={args.pairs}; the ratio is a median of at least 7 interleaved pairs")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts, make = make_clients(Path(tmp), args.concurrency, args.new_tokens)
        t0 = time.perf_counter()
        server_spec = ServerSpec(
            str(model_dir),
            dtype=args.dtype,
            deterministic=args.deterministic,
            mem_fraction_static=0.3,
            startup_timeout_s=900,  # a shared, loaded machine can take minutes
        )
        with SGLangServer(server_spec, Path(tmp) / "server.log") as server:
            print(
                f"server healthy after {time.perf_counter() - t0:.1f} s ({args.dtype}, "
                f"deterministic={args.deterministic}); load average {os.getloadavg()[0]:.1f}"
            )
            clients = make(server.url)
            for client in clients.values():  # warm-up: torch.compile of the seeded sampler, batch shapes
                client.generate(prompts, n=1, step=10_000)
            print(wire_report(server.url, clients["routes+masks"], prompts[0]))
            results: dict[str, list[float]] = {name: [] for name in clients}
            loads = []
            for pair in range(args.pairs):
                order = list(clients.items()) if pair % 2 == 0 else list(clients.items())[::-1]
                for name, client in order:  # alternate which mode goes first
                    t = time.perf_counter()
                    samples = client.generate(prompts, n=1, step=pair)
                    dt = time.perf_counter() - t
                    tokens = sum(len(s.response_ids) for s in samples)
                    results[name].append(tokens / dt)
                    print(f"{name:18s} pair {pair}: {tokens} tokens in {dt:.2f} s = {tokens / dt:.0f} tok/s")
                loads.append(os.getloadavg()[0])
    plain, full = results["plain (logprobs)"], results["routes+masks"]
    ratios = sorted(f / p for f, p in zip(full, plain))
    for name, values in results.items():
        print(
            f"median {name:18s}: {statistics.median(values):.0f} generated tok/s "
            f"(min {min(values):.0f}, max {max(values):.0f}; {args.concurrency} concurrent)"
        )
    q1, q3 = np.percentile(ratios, [25, 75])
    print(
        f"route decode: uint8 {route_decode_gbps('uint8'):.1f} GB/s, int32 (upstream) "
        f"{route_decode_gbps('int32'):.1f} GB/s int32-equivalent (8192 tokens x 48 layers x top-8)"
    )
    print(f"load average during the pairs: {min(loads):.1f}-{max(loads):.1f} (2 cores)")
    print(
        f"ratio per pair: {' '.join(f'{r:.3f}' for r in ratios)}; "
        f"spread min {ratios[0]:.3f} / IQR {q1:.3f}-{q3:.3f} / max {ratios[-1]:.3f}"
    )
    print(f"recording_throughput_ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
