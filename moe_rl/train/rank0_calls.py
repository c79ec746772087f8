"""Collectives that rank 0 starts while the other learner ranks wait for it: the re-sync of a restarted server.

Owns a small protocol between the learner ranks. Where the other ranks wait for rank 0 (its step's batch,
the start of a weight push) they wait in ``follow()`` instead of a barrier; rank 0 ``call(name, arg)``s the
collective it needs there (``handlers[name](arg)`` on every rank: today ``resync``, a weight sync of the
servers from the live weights, collective since no rank keeps a host copy of the model) and ``release()``s
them when its wait is over (``on_rank0(work)``, on every rank, is that pattern: rank 0 runs ``work`` and releases,
the others follow). With one rank ``call`` runs the handler directly.

A call is made by rank 0's main thread (the one that also releases). A thread of rank 0 that is not the
main one (the thread answering the async rollout process) ``request()``s instead and blocks until the main
thread has ``serve()``d it at its next wait (``wait``: ``RolloutProcess`` serves while the learner waits for a
batch, for the batch in flight before a push, or for an eval): no collective ever runs on two threads at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

__all__ = ["Rank0Calls"]

T = TypeVar("T")


class Rank0Calls:
    """``call`` / ``request`` / ``serve`` / ``release`` (rank 0), ``follow`` (the other ranks), ``on_rank0(work)``
    (every rank: rank 0 works, the others follow)."""

    def __init__(self, handlers: dict[str, Callable[[object], None]]):
        self.handlers = handlers
        self.main = threading.main_thread()
        self._requests: queue.Queue = queue.Queue()

    @property
    def on(self) -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1

    def _bcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)  # size: a call name and its small argument (a label): < 1 KB
        return box[0]

    # ------------------------------------------------------------------ rank 0
    def call(self, name: str, arg=None):
        """Run handler ``name`` on every rank now (rank 0's main thread; the others are in ``follow``), or
        from another thread of rank 0 ``request`` it; rank 0's handler's return value."""
        if threading.current_thread() is not self.main:
            return self.request(name, arg)
        if self.on:
            self._bcast((name, arg))
        return self.handlers[name](arg)

    def request(self, name: str, arg=None):
        """From a thread that is not the main one: wait until the main thread has run ``name`` everywhere; rank 0's
        handler's return value."""
        done: dict = {"event": threading.Event()}
        self._requests.put((name, arg, done))
        done["event"].wait()
        if "error" in done:
            raise done["error"]
        return done.get("value")

    @property
    def pending(self) -> bool:
        return not self._requests.empty()

    def serve(self) -> None:
        """Rank 0's main thread: run every requested call (each on every rank) and wake its requester."""
        while True:
            try:
                name, arg, done = self._requests.get_nowait()
            except queue.Empty:
                return
            try:
                done["value"] = self.call(name, arg)
            except BaseException as err:  # handed to the requesting thread
                done["error"] = err
                raise
            finally:
                done["event"].set()

    def wait(self, cond: threading.Condition, done: Callable[[], bool], serve: bool = True) -> None:
        """``cond.wait_for(done)`` (``cond`` held) that meanwhile serves the requested calls, outside the lock; only
        where the other ranks wait for rank 0 in ``follow()`` (``serve``)."""
        while not done():
            if serve and self.pending:
                cond.release()
                try:
                    self.serve()
                finally:
                    cond.acquire()
                continue
            cond.wait(timeout=0.05 if serve else None)

    def cancel(self, why: str) -> None:
        """Fail every request not yet served (the main thread is leaving: nobody will run them)."""
        while True:
            try:
                _, _, done = self._requests.get_nowait()
            except queue.Empty:
                return
            done["error"] = RuntimeError(why)
            done["event"].set()

    def release(self) -> None:
        """Rank 0: the other ranks leave ``follow``."""
        if self.on:
            self._bcast(None)

    # ------------------------------------------------------------------ every rank
    def on_rank0(self, work: Callable[[], T]) -> T | None:
        """Every rank, where the others wait for rank 0: rank 0 runs ``work()`` (its main thread) and then
        ``release()``s; the other ranks ``follow()`` meanwhile, running every collective it calls. ``work()``'s
        result on rank 0, None on the others."""
        if dist.is_initialized() and dist.get_rank() != 0:
            self.follow()
            return None
        result = work()
        self.release()
        return result

    # ------------------------------------------------------------------ the other ranks
    def follow(self) -> None:
        """Run every collective rank 0 calls until it releases (a barrier that can do work)."""
        if not self.on:
            return
        while (msg := self._bcast(None)) is not None:
            name, arg = msg
            self.handlers[name](arg)
