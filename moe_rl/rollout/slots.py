"""Request slots shared by every batch one rollout client generates at once, handed out oldest step first.

Owns ``rollout.max_concurrency`` across batches. In async mode several steps' batches can be in flight
(``moe_rl.source.producer``), each on a thread with an event loop of its own; with a gate per batch the servers
would see ``max_concurrency`` requests per batch, and the oldest step (the one the learner waits for) would share
them with the next. Here the client holds one pool of slots: a request takes a slot before it is sent and keeps it
through its retries and continuations; a freed slot goes to the waiting request of the lowest step (ties: first
come), whatever thread or loop it waits on. So samples stream: the next step's requests fill the slots the
current step's tail frees, and never take one while an older step still has a request waiting.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading

__all__ = ["StepSlots"]


class StepSlots:
    """``slots`` request slots for any number of event loops (threads); ``async with slots.gate(step):``."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"slots={slots}; expected >= 1")
        self._lock = threading.Lock()
        self._free = int(slots)
        self._waiting: list[tuple[int, int, list]] = []  # heap of (step, arrival, [loop, future, granted])
        self._arrivals = itertools.count()

    def gate(self, step: int) -> _Gate:
        """An async context manager (reusable) holding one slot for a request of ``step``."""
        return _Gate(self, int(step))

    @property
    def free(self) -> int:
        with self._lock:
            return self._free

    async def acquire(self, step: int) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._free > 0:  # nobody waits while a slot is free (release hands it on first)
                self._free -= 1
                return
            entry = (step, next(self._arrivals), [loop, loop.create_future(), False])
            heapq.heappush(self._waiting, entry)
        waiter = entry[2]
        try:
            await waiter[1]
        except asyncio.CancelledError:  # e.g. another request of the batch failed: its TaskGroup cancels the rest
            with self._lock:
                granted = waiter[2]
                if not granted:
                    self._waiting.remove(entry)
                    heapq.heapify(self._waiting)
            if granted:  # handed a slot as it was cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        with self._lock:
            while self._waiting:
                _, _, waiter = heapq.heappop(self._waiting)
                waiter[2] = True
                try:
                    waiter[0].call_soon_threadsafe(_wake, waiter[1])
                    return
                except RuntimeError:  # its loop is closed: nobody waits there any more
                    continue
            self._free += 1


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class _Gate:
    def __init__(self, slots: StepSlots, step: int):
        self.slots, self.step = slots, step

    async def __aenter__(self) -> None:
        await self.slots.acquire(self.step)

    async def __aexit__(self, *exc) -> None:
        self.slots.release()
