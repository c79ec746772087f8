"""Client CPU per ``/generate`` request: httpx (the rollout client before) vs aiohttp (``moe_rl.rollout.http_session``).

Issue 36: in async mode the rollout process shares two cores with the learner and the server, so the client's CPU per
request is generation time or training time lost. A stand-in server (aiohttp, in a process of its own pinned to
``--server-cpu``) answers each POST after ``--delay-ms`` with a body the size of a demo reply (12 tokens, log-probs,
routes); this process, pinned to ``--client-cpu``, sends ``--requests`` POSTs, ``--concurrency`` in flight, through
each client in turn (``--rounds`` rounds, interleaved). Per client: the median over rounds of this process's CPU
time per request, and of the batch's wall time. The server is a stand-in because the point is the client's own cost,
which does not depend on what generates the reply. The last line is ``httpx_vs_aiohttp_cpu=<ratio of medians>``.

  .venv/bin/python bench/bench_http_client.py [--rounds 5] [--requests 128] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_rl.rollout.http_session import Session
from moe_rl.rollout.ports import free_port

SERVER = """
import asyncio, json, sys
from aiohttp import web
REPLY = json.dumps({"output_ids": list(range(12)), "meta_info": {"prompt_tokens": 20, "finish_reason": {"type": "stop"},
    "output_token_logprobs": [[-0.5, i, None] for i in range(12)], "routed_experts": "A" * 400,
    "weight_version": "step-3"}}).encode()
async def generate(request):
    await request.read()
    await asyncio.sleep(float(sys.argv[2]) / 1000)
    return web.Response(body=REPLY, content_type="application/json")
app = web.Application()
app.router.add_post("/generate", generate)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""

BODY = {
    "input_ids": list(range(20)),
    "sampling_params": {"max_new_tokens": 13, "temperature": 3.0, "sampling_seed": 5},
    "return_logprob": True,
    "return_routed_experts": True,
}


async def with_httpx(url: str, n: int, concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as http:

        async def one():
            async with gate:
                json.loads((await http.post(url, json=BODY)).content)

        await asyncio.gather(*[one() for _ in range(n)])


async def with_aiohttp(url: str, n: int, concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)
    async with Session(concurrency, 120.0, {}) as http:

        async def one():
            async with gate:
                json.loads((await http.post_json(url, BODY))[1])

        await asyncio.gather(*[one() for _ in range(n)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--delay-ms", type=float, default=9.0, help="the stand-in server's time per request")
    parser.add_argument("--client-cpu", type=int, default=0)
    parser.add_argument("--server-cpu", type=int, default=1)
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.client_cpu})
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(args.delay_ms)])
    os.sched_setaffinity(server.pid, {args.server_cpu})
    url = f"http://127.0.0.1:{port}/generate"
    try:
        for _ in range(100):  # until it listens
            try:
                httpx.post(url, json=BODY, timeout=1.0)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        clients = {"httpx": with_httpx, "aiohttp": with_aiohttp}
        cpu = {name: [] for name in clients}
        wall = {name: [] for name in clients}
        for name, run in clients.items():  # warm-up: imports, first connections
            asyncio.run(run(url, args.requests, args.concurrency))
        for _ in range(args.rounds):
            for name, run in clients.items():
                c0, w0 = time.process_time(), time.perf_counter()
                asyncio.run(run(url, args.requests, args.concurrency))
                cpu[name].append((time.process_time() - c0) / args.requests * 1e3)
                wall[name].append(time.perf_counter() - w0)
        for name in clients:
            print(
                json.dumps(
                    {
                        "client": name,
                        "cpu_ms_per_request": round(statistics.median(cpu[name]), 3),
                        "cpu_ms_min_max": [round(min(cpu[name]), 3), round(max(cpu[name]), 3)],
                        "batch_wall_s": round(statistics.median(wall[name]), 3),
                    }
                ),
                flush=True,
            )
        print(f"httpx_vs_aiohttp_cpu={statistics.median(cpu['httpx']) / statistics.median(cpu['aiohttp']):.2f}")
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
