"""One pool of request slots for every batch a rollout client generates at once (``moe_rl.rollout.slots``): real
threads, each with its own event loop, as the async producer runs them; the servers are a stand-in (``_post`` and
``_to_sample`` replaced: the point is which request holds a slot, not SGLang)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from moe_rl.rollout.client import RolloutClient, sample_seed
from moe_rl.rollout.slots import StepSlots


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", asyncio.run(fn())))
    thread.start()
    return thread, box


def _queued(slots, n):
    deadline = time.monotonic() + 10
    while len(slots._waiting) < n:
        assert time.monotonic() < deadline, f"{n} waiters never queued"
        time.sleep(0.002)


def test_a_freed_slot_goes_to_the_oldest_step_then_to_the_first_come():
    slots, order = StepSlots(1), []
    holder_in, release = threading.Event(), threading.Event()

    async def holder():
        async with slots.gate(0):
            holder_in.set()
            while not release.is_set():
                await asyncio.sleep(0.005)

    def waiter(step, name):
        async def run():
            async with slots.gate(step):
                order.append(name)

        return run

    t0, _ = _in_thread(holder)
    assert holder_in.wait(10)
    late_steps = [_in_thread(waiter(1, "step 1, first come"))]
    _queued(slots, 1)
    late_steps.append(_in_thread(waiter(1, "step 1, second")))
    _queued(slots, 2)
    old_step = _in_thread(waiter(0, "step 0, came last"))
    _queued(slots, 3)
    release.set()
    for thread, _ in [(t0, None), *late_steps, old_step]:
        thread.join(10)
    assert order == ["step 0, came last", "step 1, first come", "step 1, second"]
    assert slots.free == 1


def test_a_cancelled_waiter_leaves_no_slot_taken():
    """A batch's first failure cancels its other requests (TaskGroup): waiting ones leave the queue, and one
    handed a slot as it was cancelled passes it on."""
    slots = StepSlots(1)

    async def run():
        await slots.acquire(0)
        waiting = asyncio.ensure_future(slots.acquire(1))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        granted = asyncio.ensure_future(slots.acquire(1))
        await asyncio.sleep(0.01)
        slots.release()  # hands the slot to `granted` ...
        granted.cancel()  # ... cancelled before it ran: the slot is passed on (here: back to the pool)
        with pytest.raises(asyncio.CancelledError):
            await granted

    asyncio.run(run())
    assert slots.free == 1


def test_two_steps_generated_at_once_share_max_concurrency_and_the_older_goes_first(monkeypatch):
    """Step 0's batch (12 requests) and step 1's (12), on two threads as the async producer runs them, with
    ``max_concurrency=3``: never more than 3 requests in flight in all, and no request of step 1 is sent while one
    of step 0 still waits for a slot. Break tried: a semaphore per batch (as before) fails both."""
    client = RolloutClient(["http://a"], None, 64, max_concurrency=3, return_sampling_mask=False)
    lock, in_flight, peak, sent = threading.Lock(), [0], [0], []

    async def post(http, url, body):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            sent.append(body["sampling_params"]["sampling_seed"])
        await asyncio.sleep(0.02)
        with lock:
            in_flight[0] -= 1
        return {}, False  # (reply, ran past its bound)

    monkeypatch.setattr(client, "_post", post)
    reply = SimpleNamespace(response_ids=[5], token_versions=None)
    monkeypatch.setattr(client, "_to_sample", lambda reply_, prompt, group_id, url, start=0, own=False: reply)
    seeds = {}
    threads = []
    for step in (0, 1):
        seeds[step] = {b["sampling_params"]["sampling_seed"] for b in _bodies(client, step)}
        threads.append(threading.Thread(target=client.generate, args=([[1, 2]] * 6, 2), kwargs={"step": step}))
        threads[-1].start()
        if step == 0:  # step 1 arrives while step 0 has 3 requests in flight and 9 waiting for a slot
            _queued(client._slots, 9)
    for t in threads:
        t.join(30)
    steps = [0 if s in seeds[0] else 1 for s in sent]
    assert len(sent) == 24 and peak[0] <= 3, (len(sent), peak[0])
    assert steps == sorted(steps), steps


def _bodies(client, step):
    return [
        {"sampling_params": {"sampling_seed": sample_seed(client.seed, step, g, j)}} for g in range(6) for j in range(2)
    ]
