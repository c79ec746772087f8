"""The batch watchdog probes only a server that has stopped replying (``moe_rl.rollout.health``).

SGLang's ``/health`` generates a token and holds the model-update read lock for up to a second, so a probe near
a batch's end held up the weight push after it (``begin_weight_update`` waits for that lock's write side).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import httpx
import numpy as np
import pytest

from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.health import ServerHungError, run_may_pause, watch_health
from moe_rl.rollout.ports import free_port
from moe_rl.sync import senders


def test_a_server_that_replies_is_not_probed_and_one_that_stops_is(device):
    """Nothing listens at the address, so every probe fails: only the replies keep the watchdog quiet."""

    async def main():
        address = f"http://127.0.0.1:{free_port()}"
        replied = {address: time.monotonic()}

        async def replying():
            while True:
                replied[address] = time.monotonic()
                await asyncio.sleep(0.05)

        feeder = asyncio.ensure_future(replying())
        with pytest.raises(TimeoutError):  # probed, it would be hung at 1.5 s
            await asyncio.wait_for(watch_health([address], 1.5, replied=replied), 3.0)
        feeder.cancel()
        t0 = time.monotonic()
        with pytest.raises(ServerHungError, match="has not answered /health for"):
            await asyncio.wait_for(watch_health([address], 1.5, replied=replied), 6.0)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 3.0


class _ReplyTimes(dict):
    """The client's ``address -> time of its last reply`` map (what the watchdog reads), keeping every time set."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def __setitem__(self, address: str, when: float) -> None:
        self.times.append(when)
        super().__setitem__(address, when)


def _silences(start: float, replies: list[float], end: float, interval: float) -> int:
    """Probes a watchdog checking every ``interval`` may send in this batch: within each gap between replies (and
    from the start, and to the end) of at least an interval, at most one per interval after the first."""
    marks = [start, *sorted(t for t in replies if start <= t <= end), end]
    return sum(int((b - a) // interval) for a, b in itertools.pairwise(marks))


@pytest.mark.sglang
def test_a_push_after_a_long_batch_waits_for_no_probe(sglang_server, route_spec, device):
    """A batch longer than two probe intervals (3 s at health_timeout_s=9): a ``/health`` probe reaches the server
    only in a silence of a whole interval between its replies -- none on an idle machine, where the replies of this
    2-at-a-time batch come ~0.1 s apart (a loaded CI machine once spaced two of them more than an interval apart,
    and the watchdog then rightly probed: the allowance counts the silences the client saw) -- and the push's
    ``begin_weight_update`` right after the batch is not held up by one (a probe holds SGLang's lock ~1 s)."""
    log = sglang_server.log_path
    interval = 3.0  # health.watch_health's: health_timeout_s / 3
    client = RolloutClient(
        [sglang_server.url],
        route_spec,
        512,
        SamplingSettings(max_new_tokens=12),
        max_concurrency=2,
        health_timeout_s=9.0,
    )
    rng = np.random.default_rng(0)
    client.generate([[5, 6, 7]])  # a fresh server's first request takes seconds of warm-up: no reply, so probed
    time.sleep(1.2)  # a probe's access-log line is written when its handler returns (up to ~1 s later)
    probes = log.read_text(errors="replace").count('"GET /health HTTP')
    client._replied = replies = _ReplyTimes()  # the real map the watchdog reads, its history kept
    count, batch_s, allowed = 32, 0.0, 0
    while batch_s < 6.5:  # longer than two probe intervals, on a faster machine too
        prompts = [rng.integers(4, 512, size=int(rng.integers(5, 20))).tolist() for _ in range(count)]
        t0 = time.monotonic()
        client.generate(prompts, n=2)
        batch_s = time.monotonic() - t0
        allowed += _silences(t0, replies.times, t0 + batch_s, interval)
        count = max(2 * count, int(count * 7.5 / max(batch_s, 0.1)))  # the next try is long enough
    assert len(replies.times) >= 2 * len(prompts), "the recorder saw every reply of the batch"
    t1 = time.monotonic()
    refused = senders.begin([sglang_server.url], {}, 30.0)
    begin_s = time.monotonic() - t1
    assert not refused, refused
    assert not senders.end([sglang_server.url], {}, 30.0)
    t2 = time.monotonic()  # the same call with no batch and no watchdog before it: this machine's own pace
    assert not senders.begin([sglang_server.url], {}, 30.0) and not senders.end([sglang_server.url], {}, 30.0)
    idle_s = (time.monotonic() - t2) / 2
    httpx.post(f"{sglang_server.url}/flush_cache", timeout=60).raise_for_status()
    time.sleep(1.2)  # a probe's access-log line is written when its handler returns (up to ~1 s later)
    sent = log.read_text(errors="replace").count('"GET /health HTTP') - probes
    assert sent <= allowed, f"{sent} /health probes reached a server that replied at least once per interval"
    if allowed == 0:
        assert begin_s < idle_s + 0.5, f"begin_weight_update took {begin_s:.3f} s after the batch (idle {idle_s:.3f})"


@pytest.mark.sglang
def test_an_idle_healthy_server_is_not_called_hung_at_a_short_timeout(sglang_server, device):
    """No replies, so the watchdog probes. SGLang answers ``/health`` after ~1 s: at ``health_timeout_s=1.5`` (a 0.5 s
    interval) a probe that gave up after one interval failed every time, and the idle server was called hung."""

    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(watch_health([sglang_server.url], 1.5), 4.5)

    asyncio.run(main())


@pytest.mark.sglang
def test_a_server_paused_from_outside_the_run_is_resumed_and_one_the_run_pauses_is_not(sglang_server, caplog):
    """Issue 57: an admin's ``/pause_generation`` during a batch. The watchdog finds the paused server silent, sees it up
    but paused and resumes it (one line), unless the run holds a pause section itself: then the paused server is
    left alone (and, silent past the timeout, hung as before)."""
    url = sglang_server.url
    httpx.post(f"{url}/pause_generation", json={"mode": "abort"}, timeout=60).raise_for_status()
    try:

        async def guarded():
            with run_may_pause(), pytest.raises(ServerHungError):
                await asyncio.wait_for(watch_health([url], 1.5), 8.0)

        asyncio.run(guarded())
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 503, "the run's own pause was resumed"

        async def outside():
            with pytest.raises(TimeoutError):  # resumed, then answering: never hung
                await asyncio.wait_for(watch_health([url], 1.5), 6.0)

        with caplog.at_level(logging.WARNING, logger="moe_rl.rollout.health"):
            asyncio.run(outside())
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
        lines = [r.getMessage() for r in caplog.records if "paused by an outside /pause_generation" in r.getMessage()]
        assert len(lines) == 1 and "resumed it" in lines[0], caplog.text
    finally:
        httpx.post(f"{url}/continue_generation", json={}, timeout=60)
