"""Async mode's batch source on learner rank 0: a rollout process beside the learner, driven through a pipe.

Owns the learner side of ``moe_rl.source.rollout_worker``: it spawns the rollout process (pinned to
``rollout.process_cpus``; default: the trainer's cores and the servers' ``rollout.server_cpus`` together, see
``process_cpus``), and offers the loop what ``AsyncProducer`` offered it in a
thread: ``batch(step)`` (the records path, once the process has written it), ``weights_pushed``,
``exclusive`` (the process holds its producer: a push waits for or pauses the batch in flight, an eval sees the
version being trained), ``evaluate``, ``take_times``, ``checkpoint_state`` and ``close``. The learner process
does no generation HTTP and decodes no reply.

The process asks (``ask``) for what only rank 0 can do: a **re-sync** (``WeightPusher.resync``: collective over
every learner rank, so it is ``Rank0Calls.request``ed and runs at the main thread's next wait, where the other
ranks follow: its batch wait, a push section, an eval; the answer is what the servers then hold, the version
included) and a **restart** of a dead server (the run's one supervisor, ``ServerPool``, under the pool's lock; the
answer also names the servers rank 0 restarted before a push since the process last asked, on one of which its
request may have failed). Each ask is answered on its own thread, so a pending re-sync never blocks the pipe.
Every wait of the main thread here notices the process dying.

**Supervision.** A watch on the process's sentinel wakes the main thread's waits as soon as the process dies (kill -9, an
OOM kill, an exception in it, whose last line it sends first), not a pipe error later. The death is logged in one line
naming the pid and the signal or the error, and the process is started again from the last handed-over step
(``moe_rl.source.rollout_restart``: the finished records not yet trained are handed to it, the steps after them are
made again from the prompt-stream position before them; it gets the served version and fingerprints, and the holds
of a push or an eval in progress, before it may generate), at most ``rollout.max_process_restarts`` times. Past that,
or before the run began, ``RolloutProcessError`` ends the run with that line (exit code 2).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_ready
from pathlib import Path

from moe_rl.source.producer import raise_batch_failure
from moe_rl.source.rollout_restart import RestartPoint, RolloutProcessError, death_line
from moe_rl.source.rollout_worker import WorkerSpec, portable_error, worker_main

__all__ = ["RolloutProcess", "RolloutProcessError", "process_cpus"]

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # imports, tokenizer, dataset and reward workers of the process
DRAIN_S = 5.0  # after a death: for its last messages (a finished step, its error) to be read


def process_cpus(rollout) -> list[int]:
    """The rollout process's cores (module docstring): ``rollout.process_cpus``, else the trainer's cores and the
    servers' (``rollout.server_cpus``) together, so the scheduler runs it wherever a core is free; [] = the trainer's
    own (what a spawned child inherits)."""
    if rollout.process_cpus:
        return list(rollout.process_cpus)
    if rollout.server_cpus:
        return sorted(os.sched_getaffinity(0) | set(rollout.server_cpus))
    return []


class _Restarted(Exception):
    """The process died during a wait and a new one took its place: the waiter asks it again."""


class RolloutProcess:
    """Rank 0's async batch source (module docstring)."""

    mode = "async"

    def __init__(self, spec: WorkerSpec, max_restarts: int = 0):
        self.spec, self.max_restarts, self.restarts = spec, int(max_restarts), 0
        self.calls = None  # rank 0's Rank0Calls (begin)
        self.answers: dict[str, Callable] = {"resync": self._resync, "restart": self._restart}  # ask name -> answer
        self._weights = self._pool = self._keys = None  # rank 0's WeightPusher, ServerPool and keys (begin)
        self._addresses: list[str] = []
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._ready: dict[int, Path] = {}
        self._replies: dict[int, tuple] = {}
        self._ids = iter(range(1 << 62))
        self._error: tuple[int | None, BaseException] | None = None
        self._wait_s = 0.0
        self._closed = self._begun = self._producing = False
        self._holds = 0  # exclusive() sections entered: a new process is held as many times
        self.point = RestartPoint(spec.data_state)
        atexit.register(self.close)  # before multiprocessing's own exit handler, which would wait for it
        self._launch(spec)

    # ------------------------------------------------------------------ the process and its pipe
    def _launch(self, spec: WorkerSpec) -> None:
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        # not a daemon: it starts reward workers of its own; close() ends it, and it dies with this process
        proc = ctx.Process(target=worker_main, args=(child, spec), name="moe_rl-rollout")
        proc.start()
        child.close()
        with self._cond:
            self.proc, self._conn = proc, conn
            self._started = self._gone = False
            self._crash: str | None = None
        self._reader = threading.Thread(target=self._read, args=(conn, proc), name="moe_rl-rollout-pipe", daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, args=(proc,), name="moe_rl-rollout-watch", daemon=True).start()

    def _watch(self, proc) -> None:
        """Wake every wait once ``proc`` has exited (its sentinel; the pipe may not say so for a while)."""
        wait_ready([proc.sentinel])
        with self._cond:
            if proc is self.proc:
                self._gone = True
            self._cond.notify_all()

    def _read(self, conn, proc) -> None:
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "ask":
                    threading.Thread(target=self._answer, args=(conn, *msg[1:]), daemon=True).start()
                    continue
                with self._cond:
                    if proc is not self.proc:  # a replaced process's late message
                        continue
                    if msg[0] == "made":
                        self._ready[int(msg[1])] = Path(msg[2])
                    elif msg[0] == "drawn":
                        self.point.drawn(msg[1], msg[2])
                    elif msg[0] == "failed":
                        self._error = (msg[1], msg[2])
                    elif msg[0] == "reply":
                        self._replies[msg[1]] = (msg[2], msg[3])
                    elif msg[0] == "ready":
                        self._started = True
                    elif msg[0] == "crashed":
                        self._crash = msg[1]
                    self._cond.notify_all()
        except (EOFError, OSError):
            with self._cond:
                if proc is self.proc:
                    self._gone = True
                self._cond.notify_all()

    def _send(self, *msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _answer(self, conn, req: int, name: str, args: tuple) -> None:
        try:
            value, err = self.answers[name](*args), None
        except BaseException as exc:  # noqa: BLE001 -- raised in the process, where the batch fails with it
            value, err = None, portable_error(exc)
        with contextlib.suppress(OSError), self._send_lock:  # to the process that asked (a dead one: dropped)
            conn.send(("reply", req, err, value))

    def _wait(self, done: Callable[[], bool], serve: bool, what: str) -> None:
        """Wait (``_cond`` held) for ``done`` or a dead process; serving rank 0's requested calls where ``serve``. A
        dead process is restarted (``_Restarted``: ask again) or ends the run (``RolloutProcessError``)."""

        def over():
            return done() or self._gone or not self.proc.is_alive()

        if self.calls is None or not serve:  # (polled: a start's deadline is checked)
            while not over():
                self._cond.wait(timeout=0.5)
        else:
            self.calls.wait(self._cond, over, serve)
        if done():
            return
        if self._error is not None:
            raise_batch_failure(self._error[0], self._error[1], "the rollout process")
        self._cond.release()
        try:
            self._replace(what)
        finally:
            self._cond.acquire()
        raise _Restarted

    def _ask(self, what: str, *args, serve: bool = False, again: bool = True):
        """The process's answer to ``what``; asked again of a restarted process (unless ``again`` is false)."""
        while True:
            req = next(self._ids)
            with contextlib.suppress(OSError):  # a dead process: the wait notices and restarts it
                self._send(what, req, *args)
            try:
                with self._cond:
                    self._wait(lambda req=req: req in self._replies, serve, f"its answer to {what!r}")
                    err, value = self._replies.pop(req)
            except _Restarted:
                if again:
                    continue
                raise
            if err is not None:
                raise err
            return value

    # ------------------------------------------------------------------ supervision
    def _replace(self, what: str) -> None:
        """The process is dead (or its pipe broken): name it in one line and start another from the last
        handed-over step (module docstring), or raise ``RolloutProcessError``."""
        proc = self.proc
        proc.join(timeout=DRAIN_S)
        if proc.is_alive():  # its pipe broke but it lives on: it cannot be talked to
            proc.kill()
            proc.join(timeout=10)
        self._reader.join(timeout=DRAIN_S)  # its last messages: a finished step, its error
        line = death_line(proc.pid, proc.exitcode, self._crash)
        if self._closed or not self._begun:
            raise RolloutProcessError(f"{line} while the learner waited for {what}")
        if self.restarts >= self.max_restarts:
            raise RolloutProcessError(f"{line}; all rollout.max_process_restarts={self.max_restarts} restarts are used")
        self.restarts += 1
        with self._cond:
            try:
                pending, position = self.point.resume(self._ready)
            except RolloutProcessError as exc:
                raise RolloutProcessError(f"{line}; {exc}") from None
            start, served = self.point.next, self.point.served
        logger.warning(
            "%s; restarted from step %d (restart %d/%d, rollout.max_process_restarts)",
            line,
            start + 1,
            self.restarts,
            self.max_restarts,
        )
        self._launch(dataclasses.replace(self.spec, data_state=position))
        self.wait_started()
        pending_paths = {s: str(p) for s, p in pending.items()}
        state = self._weights.served_state()
        self._ask("begin", self._addresses, self._keys, start, served, pending_paths, state, again=False)
        for _ in range(self._holds):  # a push or an eval in progress: the new process starts nothing until left
            self._ask("hold", False, again=False)
        if self._producing:
            self._send("start")

    def _resync(self, served: int) -> dict | None:
        """Runs at rank 0's next wait, on every rank; what the servers then hold (the version the live weights are, and
        the fingerprints the process checks the served weights against)."""
        version = self._weights.resync(self._addresses, served)  # the version it pushed, whatever rank 0 does next
        state = self._weights.served_state()
        return None if state is None else {**state, "version": version}

    def _restart(self, urls=None, seen: int = 0) -> tuple[list[str], int]:
        """The servers named (None: the dead ones) restarted, and those restarted by anyone since the asking batch
        knew of ``seen`` restarts; ``(URLs, restarts now)`` (``ServerPool.restart_since``)."""
        return self._pool.restart_since(seen, urls)

    # ------------------------------------------------------------------ the loop's batch source
    @classmethod
    def spawn(cls, spec: WorkerSpec, max_restarts: int = 0) -> RolloutProcess:
        """The process, started with its prompts, rewards and eval sets (a bad dataset or reward raises here)."""
        source = cls(spec, max_restarts)
        try:
            source.wait_started()
        except BaseException:
            source.close()
            raise
        return source

    def wait_started(self) -> None:
        """Until the process has its prompts, rewards and eval sets (a bad dataset or reward raises here)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        with self._cond:
            self._wait(
                lambda: self._started or self._error is not None or time.monotonic() > deadline, False, "it to start"
            )
            if self._error is not None:
                raise self._error[1]
            if not self._started:
                raise RuntimeError(f"the rollout process did not start within {START_TIMEOUT_S:.0f} s")

    def begin(
        self, addresses, keys, start_step: int, served_version: int, pending: dict[int, Path], weights, pool
    ) -> None:
        """The servers are up: the process makes its client and its producer (steps from ``start_step``); its asks are
        answered by rank 0's ``weights`` (``WeightPusher``) and ``pool`` (``ServerPool``)."""
        self._weights, self._pool, self._addresses, self._keys = weights, pool, list(addresses), keys
        self.calls = weights.calls
        with self._cond:
            self._ready.update(pending)  # a resumed checkpoint's finished batches: the process will not make them
            self.point.began(start_step, served_version, pending)
        pending = {s: str(p) for s, p in pending.items()}
        self._ask(
            "begin", list(addresses), keys, start_step, served_version, pending, weights.served_state(), again=False
        )
        self._begun = True

    def start(self) -> None:
        self._producing = True
        with contextlib.suppress(OSError):  # a dead process: the next wait notices and restarts it
            self._send("start")

    def batch(self, step: int) -> Path:
        """Step ``step``'s records, once written (waiting is ``time/learner_wait_s``; re-syncs are served meanwhile)."""
        t0 = time.perf_counter()
        failed = lambda: self._error is not None and (self._error[0] is None or self._error[0] <= step)
        try:
            while True:
                try:
                    with self._cond:
                        self._wait(lambda: step in self._ready or failed(), True, f"step {step + 1}'s batch")
                        if step not in self._ready:
                            raise_batch_failure(step, self._error[1], "the rollout process")
                        self.point.taken(step)
                        return self._ready.pop(step)
                except _Restarted:  # the new process makes it (or was handed it)
                    continue
        finally:
            with self._cond:
                self._wait_s += time.perf_counter() - t0

    def weights_pushed(self, version: int) -> None:
        """The servers hold ``version`` (and its fingerprints): steps up to ``version + k`` may start."""
        with self._cond:
            self.point.served = int(version)  # a process restarted from here on starts at this version
        self._ask("pushed", int(version), self._weights.served_state())

    @contextlib.contextmanager
    def exclusive(self, wait_for_batch: bool = True, serve: bool = False):
        """The process's producer waits for its batch in flight (``wait_for_batch``) and starts nothing until left. The
        learner's wait for it counts in ``time/learner_wait_s`` (before a push it used to be counted nowhere)."""
        t0 = time.perf_counter()
        self._ask("hold", bool(wait_for_batch), serve=serve)
        with self._cond:
            self._wait_s += time.perf_counter() - t0
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            with contextlib.suppress(OSError):
                self._send("unhold")

    def evaluate(self, step: int, version: str) -> dict[str, float]:
        """The eval sets at the served weights, generated and scored by the process (the other ranks follow)."""
        return self._ask("eval", step, version, serve=True)

    def take_times(self) -> dict[str, float]:
        """``time/learner_wait_s`` (here) and ``time/rollout_idle_s`` (the process's) since the last call."""
        times = self._ask("times")
        with self._cond:
            times["time/learner_wait_s"], self._wait_s = self._wait_s, 0.0
        return times

    def checkpoint_state(self, next_step: int) -> tuple[dict, dict[str, Path]]:
        extra, files = self._ask("state", int(next_step))
        return extra, {name: Path(p) for name, p in files.items()}

    def close(self) -> None:
        """End the process (a batch in flight is dropped: its prompts are taken again on resume). Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.calls is not None:
            self.calls.cancel("the trainer is closing; the re-sync was not run")
        with contextlib.suppress(OSError):
            self._send("close")
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        self._conn.close()
