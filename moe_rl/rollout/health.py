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

A server paused from outside the run (an admin's ``/pause_generation``) answers no probe either: a failed probe
asks ``/ready`` (503 while paused) and ``/model_info`` (200: the HTTP side is up), and a server paused while this
process holds no ``run_may_pause`` section (the run's own pauses: ``moe_rl.rollout.partial.paused_generation``, and
the async producer's exclusive section, inside which the trainer pauses) is resumed with ``/continue_generation``
(admin key), one line logged, at most once per server per batch; a server still silent after that is hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import TypeVar

import httpx

from moe_rl.rollout.auth import tls

T = TypeVar("T")
logger = logging.getLogger(__name__)

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


_run_pauses = {"held": 0}  # run_may_pause sections open in this process
_run_pauses_lock = threading.Lock()


@contextlib.contextmanager
def run_may_pause():
    """Held while this process (the run) may pause the servers itself: the watchdog resumes no paused server then."""
    with _run_pauses_lock:
        _run_pauses["held"] += 1
    try:
        yield
    finally:
        with _run_pauses_lock:
            _run_pauses["held"] -= 1


def run_is_pausing() -> bool:
    return _run_pauses["held"] > 0


async def _resume_if_paused(http: httpx.AsyncClient, address: str, admin_headers: dict | None) -> bool:
    """Resume ``address`` if it is up but paused and the run is not pausing (module docstring); True if resumed."""
    if run_is_pausing():
        return False
    try:
        ready = await http.get(f"{address}/ready", timeout=PROBE_TIMEOUT_S)
        up = await http.get(f"{address}/model_info", timeout=PROBE_TIMEOUT_S)
        if ready.status_code != 503 or up.status_code != 200 or run_is_pausing():
            return False
        resumed = await http.post(
            f"{address}/continue_generation", json={}, headers=admin_headers or {}, timeout=PROBE_TIMEOUT_S * 10
        )
    except httpx.HTTPError:
        return False
    if resumed.status_code != 200:
        logger.warning(
            "rollout server %s is paused and this run did not pause it; /continue_generation was refused (HTTP %d): "
            "resume it (POST /continue_generation with the admin key)",
            address,
            resumed.status_code,
        )
        return False
    logger.warning(
        "rollout server %s was paused by an outside /pause_generation (this run did not pause it): resumed it "
        "(/continue_generation); the requests it held go on (any it aborted are sent again)",
        address,
    )
    return True


async def watch_health(
    addresses: Sequence[str],
    timeout_s: float,
    headers: dict | None = None,
    replied: Mapping[str, float] | None = None,
    admin_headers: dict | None = None,
) -> None:
    """Watch every address until one is silent for ``timeout_s``, then raise ServerHungError (never returns).

    ``replied``: address -> ``time.monotonic()`` of its last reply, kept by the caller while this runs; an address
    that replied within the last probe interval is not probed (module docstring). ``admin_headers``: for resuming a
    server paused from outside the run."""
    interval = max(0.5, min(5.0, timeout_s / 3))
    replied = {} if replied is None else replied
    last_ok = {a: time.monotonic() for a in addresses}
    resumed: set[str] = set()  # resumed once in this watch: a server silent after that is hung

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
                if not ok and address not in resumed and await _resume_if_paused(http, address, admin_headers):
                    resumed.add(address)
                    ok = True
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
    admin_headers: dict | None = None,
) -> T:
    """Await ``work`` while watching ``addresses`` (``replied``, ``admin_headers``: see ``watch_health``); a hung
    server cancels it and raises ServerHungError."""
    if not timeout_s:
        return await work
    job = asyncio.ensure_future(work)
    watchdog = asyncio.ensure_future(watch_health(addresses, timeout_s, headers, replied, admin_headers))
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
