"""Detect a hung rollout server while a batch is generated.

Owns the watchdog: during a batch a server that has not replied for a probe interval gets a ``/health``
probe; one that has neither replied nor answered a probe for ``rollout.health_timeout_s`` (default 30 s)
aborts the batch with ``ServerHungError`` naming it, instead of waiting ``request_timeout_s`` x
(``max_retries`` + 1).

A reply is the proof of health, and a server that is replying is not probed: SGLang's ``/health`` is not
free. It generates one token through the scheduler (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``, on by
default), and its handler holds the tokenizer manager's model-update read lock until its once-a-second
check sees a reply. A weight push's ``/begin_weight_update`` takes that lock's write side, so a probe sent
near a batch's end held up the push after it by up to a second (0.6-0.85 s at the first push of every
async run of ``bench/bench_async.py``, whose first batches outlast the 5 s probe interval).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import TypeVar

import httpx

from moe_rl.rollout.auth import tls

T = TypeVar("T")

# SGLang's /health answers no sooner than ~1 s (its handler checks for the probe's token once a second): a probe
# that gave up sooner failed on every healthy server, and health_timeout_s <= 3 (a 1 s interval) called it hung
PROBE_TIMEOUT_S = 3.0


class ServerHungError(RuntimeError):
    """A server stopped answering ``/health``; ``address`` names it."""

    def __init__(self, address: str, silent_s: float, timeout_s: float):
        super().__init__(
            f"rollout server {address} has not answered /health for {silent_s:.0f} s "
            f"(rollout.health_timeout_s={timeout_s:g}); it is hung or overloaded"
        )
        self.address = address


async def watch_health(
    addresses: Sequence[str], timeout_s: float, headers: dict | None = None, replied: Mapping[str, float] | None = None
) -> None:
    """Watch every address until one is silent for ``timeout_s``, then raise ServerHungError (never returns).

    ``replied``: address -> ``time.monotonic()`` of its last reply, kept by the caller while this runs; an address
    that replied within the last probe interval is not probed (module docstring)."""
    interval = max(0.5, min(5.0, timeout_s / 3))
    replied = {} if replied is None else replied
    last_ok = {a: time.monotonic() for a in addresses}

    def heard(address: str) -> float:  # the latest of its last reply and its last answered probe
        last_ok[address] = max(last_ok[address], replied.get(address, -math.inf))
        return last_ok[address]

    async with httpx.AsyncClient(headers=headers or {}, verify=tls()) as http:
        while True:
            await asyncio.sleep(interval)
            for address in addresses:
                if time.monotonic() - heard(address) < interval:
                    continue  # it replied (or answered a probe) within the interval: working
                try:
                    reply = await http.get(f"{address}/health", timeout=max(interval, PROBE_TIMEOUT_S))
                    ok = reply.status_code == 200
                except httpx.HTTPError:
                    ok = False
                now = time.monotonic()
                if ok:
                    last_ok[address] = now
                elif now - heard(address) >= timeout_s:
                    raise ServerHungError(address, now - last_ok[address], timeout_s)


async def run_watched(
    work: Awaitable[T],
    addresses: Sequence[str],
    timeout_s: float | None,
    headers: dict | None = None,
    replied: Mapping[str, float] | None = None,
) -> T:
    """Await ``work`` while watching ``addresses`` (``replied``: see ``watch_health``); a hung server cancels it and
    raises ServerHungError."""
    if not timeout_s:
        return await work
    job = asyncio.ensure_future(work)
    watchdog = asyncio.ensure_future(watch_health(addresses, timeout_s, headers, replied))
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
