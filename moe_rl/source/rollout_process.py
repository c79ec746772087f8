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
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from moe_rl.source.producer import raise_batch_failure
from moe_rl.source.rollout_worker import WorkerSpec, portable_error, worker_main

__all__ = ["RolloutProcess", "process_cpus"]

START_TIMEOUT_S = 600.0  # imports, tokenizer, dataset and reward workers of the process


def process_cpus(rollout) -> list[int]:
    """The rollout process's cores (module docstring): ``rollout.process_cpus``, else the trainer's cores and the
    servers' (``rollout.server_cpus``) together, so the scheduler runs it wherever a core is free; [] = the trainer's
    own (what a spawned child inherits)."""
    if rollout.process_cpus:
        return list(rollout.process_cpus)
    if rollout.server_cpus:
        return sorted(os.sched_getaffinity(0) | set(rollout.server_cpus))
    return []


class RolloutProcess:
    """Rank 0's async batch source (module docstring)."""

    mode = "async"

    def __init__(self, spec: WorkerSpec):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # not a daemon: it starts reward workers of its own; close() ends it, and it dies with this process
        self.proc = ctx.Process(target=worker_main, args=(child, spec), name="moe_rl-rollout")
        self.proc.start()
        child.close()
        self._closed = False
        atexit.register(self.close)  # before multiprocessing's own exit handler, which would wait for it
        self.calls = None  # rank 0's Rank0Calls (begin)
        self.answers: dict[str, Callable] = {"resync": self._resync, "restart": self._restart}  # ask name -> answer
        self._weights = self._pool = None  # rank 0's WeightPusher and ServerPool (begin)
        self._addresses: list[str] = []
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._ready: dict[int, Path] = {}
        self._replies: dict[int, tuple] = {}
        self._ids = iter(range(1 << 62))
        self._started = False
        self._error: tuple[int | None, BaseException] | None = None
        self._gone = False
        self._wait_s = 0.0
        self._reader = threading.Thread(target=self._read, name="moe_rl-rollout-pipe", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ the pipe
    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "ask":
                    threading.Thread(target=self._answer, args=msg[1:], daemon=True).start()
                    continue
                with self._cond:
                    if msg[0] == "made":
                        self._ready[int(msg[1])] = Path(msg[2])
                    elif msg[0] == "failed":
                        self._error = (msg[1], msg[2])
                    elif msg[0] == "reply":
                        self._replies[msg[1]] = (msg[2], msg[3])
                    elif msg[0] == "ready":
                        self._started = True
                    self._cond.notify_all()
        except (EOFError, OSError):
            with self._cond:
                self._gone = True
                self._cond.notify_all()

    def _send(self, *msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _answer(self, req: int, name: str, args: tuple) -> None:
        try:
            value, err = self.answers[name](*args), None
        except BaseException as exc:  # noqa: BLE001 -- raised in the process, where the batch fails with it
            value, err = None, portable_error(exc)
        with contextlib.suppress(OSError):
            self._send("reply", req, err, value)

    def _wait(self, done: Callable[[], bool], serve: bool, what: str) -> None:
        """Wait (``_cond`` held) for ``done`` or a dead process; serving rank 0's requested calls where ``serve``."""

        def over():
            return done() or self._gone or not self.proc.is_alive()

        if self.calls is None:
            while not over():
                self._cond.wait(timeout=0.5)
        else:
            self.calls.wait(self._cond, over, serve)
        if not done():
            if self._error is not None:
                raise_batch_failure(self._error[0], self._error[1], "the rollout process")
            raise RuntimeError(
                f"the rollout process exited (code {self.proc.exitcode}) while the learner waited for {what}"
            )

    def _ask(self, what: str, *args, serve: bool = False):
        req = next(self._ids)
        self._send(what, req, *args)
        with self._cond:
            self._wait(lambda: req in self._replies, serve, f"its answer to {what!r}")
            err, value = self._replies.pop(req)
        if err is not None:
            raise err
        return value

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
    def spawn(cls, spec: WorkerSpec) -> RolloutProcess:
        """The process, started with its prompts, rewards and eval sets (a bad dataset or reward raises here)."""
        source = cls(spec)
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
        self._weights, self._pool, self._addresses = weights, pool, list(addresses)
        self.calls = weights.calls
        with self._cond:
            self._ready.update(pending)  # a resumed checkpoint's finished batches: the process will not make them
        pending = {s: str(p) for s, p in pending.items()}
        self._ask("begin", list(addresses), keys, start_step, served_version, pending, weights.served_state())

    def start(self) -> None:
        self._send("start")

    def batch(self, step: int) -> Path:
        """Step ``step``'s records, once written (waiting is ``time/learner_wait_s``; re-syncs are served meanwhile)."""
        t0 = time.perf_counter()
        with self._cond:
            failed = lambda: self._error is not None and (self._error[0] is None or self._error[0] <= step)
            self._wait(lambda: step in self._ready or failed(), True, f"step {step}'s batch")
            self._wait_s += time.perf_counter() - t0
            if step not in self._ready:
                raise_batch_failure(step, self._error[1], "the rollout process")
            return self._ready.pop(step)

    def weights_pushed(self, version: int) -> None:
        """The servers hold ``version`` (and its fingerprints): steps up to ``version + k`` may start."""
        self._ask("pushed", int(version), self._weights.served_state())

    @contextlib.contextmanager
    def exclusive(self, wait_for_batch: bool = True, serve: bool = False):
        """The process's producer waits for its batch in flight (``wait_for_batch``) and starts nothing until left. The
        learner's wait for it counts in ``time/learner_wait_s`` (before a push it used to be counted nowhere)."""
        t0 = time.perf_counter()
        self._ask("hold", bool(wait_for_batch), serve=serve)
        with self._cond:
            self._wait_s += time.perf_counter() - t0
        try:
            yield
        finally:
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
