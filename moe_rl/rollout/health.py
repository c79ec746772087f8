"""Detect a hung rollout server while a batch is generated.

Owns the watchdog: during a batch every server's ``/health`` is polled; a server that has not answered
200 for ``rollout.health_timeout_s`` (default 30 s) aborts the batch with ``ServerHungError`` naming it,
instead of waiting ``request_timeout_s`` x (``max_retries`` + 1). ``/health`` is answered by SGLang's
HTTP process without touching the scheduler, so probes never join (and never perturb) a batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

import httpx

from moe_rl.rollout.auth import tls

T = TypeVar("T")


class ServerHungError(RuntimeError):
    """A server stopped answering ``/health``; ``address`` names it."""

    def __init__(self, address: str, silent_s: float, timeout_s: float):
        super().__init__(f"rollout server {address} has not answered /health for {silent_s:.0f} s "
                         f"(rollout.health_timeout_s={timeout_s:g}); it is hung or overloaded")  # fmt: skip
        self.address = address


async def watch_health(addresses: Sequence[str], timeout_s: float, headers: dict | None = None) -> None:
    """Poll every address until one is silent for ``timeout_s``, then raise ServerHungError (never returns)."""
    interval = max(0.5, min(5.0, timeout_s / 3))
    last_ok = {a: time.monotonic() for a in addresses}
    async with httpx.AsyncClient(headers=headers or {}, verify=tls()) as http:
        while True:
            await asyncio.sleep(interval)
            for address in addresses:
                try:
                    ok = (await http.get(f"{address}/health", timeout=interval)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                now = time.monotonic()
                if ok:
                    last_ok[address] = now
                elif now - last_ok[address] >= timeout_s:
                    raise ServerHungError(address, now - last_ok[address], timeout_s)


async def run_watched(work: Awaitable[T], addresses: Sequence[str], timeout_s: float | None,
                      headers: dict | None = None) -> T:  # fmt: skip
    """Await ``work`` while watching ``addresses``; a hung server cancels it and raises ServerHungError."""
    if not timeout_s:
        return await work
    job = asyncio.ensure_future(work)
    watchdog = asyncio.ensure_future(watch_health(addresses, timeout_s, headers))
    try:
        await asyncio.wait({job, watchdog}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pending = [t for t in (job, watchdog) if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    if job.done() and not job.cancelled():
        return job.result()
    return watchdog.result()  # raises ServerHungError
