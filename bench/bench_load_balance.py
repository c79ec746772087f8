"""Two CPU SGLang servers, one batch of ragged requests: which server each request goes to, three ways.

Issue 36 item 4. Starts two servers of a tiny random Qwen3-MoE (written here), each pinned to a core of its own,
and times the same batch (``--prompts`` prompts x 1 sample, ``--concurrency`` in flight, routes and log-probs
recorded as in training) through:

* ``round_robin``: the client sends request ``i`` to server ``i mod 2`` (moe_rl before this bench);
* ``least_outstanding``: the client sends each request to the server with the fewest of its requests in flight
  (ties: round robin), ``rollout.load_balance``'s default;
* ``router-<policy>``: SGLang's own router (``sglang-router``, ``--router`` its import path; not a moe_rl
  dependency) in front of both, with ``--router-policy`` (``power_of_two``: its load-aware policy).

Responses are ragged as in RL: a random model rarely emits EOS, so ``--stop-tokens`` ids end a response (about
``stop/vocab`` per token: mean length ~ vocab/stop, capped at ``--new-tokens``). Modes are interleaved per round
(the order rotates), ``--rounds`` rounds; per mode the median batch wall time and its spread, and whether the
replies kept their routes. The last line is
``least_outstanding_vs_round_robin=<median round-robin wall / median least-outstanding wall>``.

  .venv/bin/python bench/bench_load_balance.py [--rounds 5] [--router /path/with/sglang_router]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from moe_rl.config import ModelConfig
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.records import RouteSpec
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.ports import free_port
from moe_rl.rollout.server_spec import ServerSpec

MODEL = ModelConfig(num_layers=2, vocab_size=512)


def start_router(path: str, urls: list[str], policy: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--worker-urls",
        *urls,
    ]
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"sglang-router exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"sglang-router did not become healthy:\n{log.read_text()[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--stop-tokens", type=int, default=12, help="ids that end a response (ragged lengths)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--router", default=None, help="a directory holding the sglang_router package (omit: no router)")
    ap.add_argument("--router-policy", default="power_of_two")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    prompts = [rng.integers(20, 512, size=int(rng.integers(16, 64))).tolist() for _ in range(args.prompts)]
    stop = list(range(4, 4 + args.stop_tokens))
    with tempfile.TemporaryDirectory(prefix="bench_lb_") as tmp:
        model_dir = Path(tmp) / "model"
        write_random_hf_checkpoint(MODEL, model_dir, seed=0)
        servers = []
        for core in (0, 1):
            spec = ServerSpec(
                str(model_dir), cpu_threads=1, cpu_affinity=(core,), mem_fraction_static=0.2, startup_timeout_s=900
            )
            servers.append(SGLangServer(spec, Path(tmp) / f"server_{core}.log").start())
        router = None
        try:
            urls = [s.url for s in servers]
            route_spec = RouteSpec.from_model_config(MODEL)
            sampling = SamplingSettings(max_new_tokens=args.new_tokens)

            def client(addresses, balance="least_outstanding"):
                return RolloutClient(
                    addresses,
                    route_spec,
                    MODEL.vocab_size,
                    sampling,
                    max_concurrency=args.concurrency,
                    return_sampling_mask=False,
                    stop_token_ids=stop,
                    load_balance=balance,
                )

            modes = {"round_robin": client(urls, "round_robin"), "least_outstanding": client(urls)}
            if args.router:
                router, router_url = start_router(args.router, urls, args.router_policy, Path(tmp) / "router.log")
                modes[f"router-{args.router_policy}"] = client([router_url])
            for name, c in list(modes.items()):  # warm-up: compile the seeded sampler, batch shapes
                try:
                    c.generate(prompts[:8], n=1, step=10_000)
                except Exception as err:  # noqa: BLE001 -- a router that cannot carry what training records
                    print(f"{name}: unusable for training rollouts: {type(err).__name__}: {str(err)[:300]}", flush=True)
                    del modes[name]
            walls, routes_ok = collections.defaultdict(list), {}
            names = list(modes)
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    t0 = time.perf_counter()
                    samples = modes[name].generate(prompts, n=1, step=r)
                    walls[name].append(time.perf_counter() - t0)
                    routes_ok[name] = all(s.routes is not None for s in samples)
                    lens = [len(s.response_ids) for s in samples]
                    print(
                        f"round {r} {name:24s} {walls[name][-1]:6.2f} s  {sum(lens)} tokens "
                        f"(len {min(lens)}-{max(lens)})  load {os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
        finally:
            if router is not None:
                router.kill()
            for s in servers:
                s.stop()
    for name in names:
        if name not in walls:
            continue
        w = sorted(walls[name])
        print(
            f"{name:24s} median {statistics.median(w):.2f} s (min {w[0]:.2f}, max {w[-1]:.2f}) over {len(w)} rounds; "
            f"routes kept: {routes_ok[name]}"
        )
    ratio = statistics.median(walls["round_robin"]) / statistics.median(walls["least_outstanding"])
    print(f"least_outstanding_vs_round_robin={ratio:.3f}")


if __name__ == "__main__":
    main()
