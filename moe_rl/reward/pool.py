"""A pool of reward worker processes with a per-call timeout measured from each call's own start.

Owns the workers: each is a spawned process (a fresh interpreter: nothing of the learner's threads or
process groups is inherited) that imports the reward function once and then runs one call at a time
in its main thread (math-verify's SIGALRM timeouts work there). The worker stamps each call's start
and end on its own clock (``time.monotonic``: CLOCK_MONOTONIC, one clock for every process of the
machine) and reports both, so a call's time is its own -- never the parent's, never another call's:

* a call that returns with ``elapsed < timeout_s`` is a result however late the parent reads it;
  one that returns at or past ``timeout_s`` is a timeout;
* a call still running at ``start + timeout_s`` (by the worker's stamp) has its worker killed and
  reported as timed out, and a replacement is spawned without waiting for it: the replacement's
  import (sympy for math-verify: seconds) overlaps the other workers' calls, and it takes calls
  once it says it is ready. Dispatch never blocks on a starting worker.

Outcomes come back in call order as ``Outcome(score, extras | error)``; what an error means is the
caller's decision. A function that cannot be imported is a ValueError naming ``reward.function``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import numbers
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Self

__all__ = ["Outcome", "RewardPool"]

STARTUP_TIMEOUT_S = 300.0  # importing a reward module (sympy for math-verify) on a loaded machine


@dataclass
class Outcome:
    """One call's result: ``score`` and the other numeric keys it returned, or ``error`` (a sentence)."""

    score: float = 0.0
    extras: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def _describe(value) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else type(value).__name__


def _normalise(value) -> tuple[float, dict[str, float]]:
    """A real number (numpy scalars and 0-d arrays included), or a dict with ``score``; anything else,
    or NaN/inf, raises ValueError saying what came back."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys {sorted(map(str, value))})")
        extras = {
            str(k): float(v)
            for k, v in value.items()
            if k != "score" and isinstance(v, numbers.Real) and not isinstance(v, bool)
        }
        value = value["score"]
    shape = getattr(value, "shape", None)
    if isinstance(value, bool) or shape not in (None, ()) or not isinstance(value, numbers.Real) and shape is None:
        raise ValueError(f"returned {_describe(value)}; expected a float or a dict with 'score'")
    try:
        score = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"returned {_describe(value)} that is not a number ({exc})") from None
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score ({score})")
    return score, extras


def _worker(conn, spec: str) -> None:
    """Worker main loop: load ``spec``, say ready, then answer ``(index, kwargs)`` calls until None.

    Per call it sends ``("started", index, t0)`` and then ``("done", index, result, error, elapsed)``.
    """
    try:
        from moe_rl.reward.custom import load_function  # noqa: PLC0415 -- optional dependency (guarded by its ImportError)

        fn = load_function(spec)
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which raises it
        conn.send(("load_error", f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)))
        return
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        index, kwargs = msg
        t0 = time.monotonic()
        conn.send(("started", index, t0))
        result, error = None, None
        try:
            value = fn(**kwargs)
        except Exception as exc:  # noqa: BLE001 -- the reward's failure is data for the parent
            error = f"raised {type(exc).__name__}: {exc}"
        else:
            try:
                result = _normalise(value)
            except Exception as exc:  # noqa: BLE001 -- any odd return value is the caller's data, never a dead worker
                error = str(exc) if isinstance(exc, ValueError) else f"returned {_describe(value)} ({exc})"
        conn.send(("done", index, result, error, time.monotonic() - t0))


class _Worker:
    """One worker process and what the parent knows of it: starting, idle, or busy with ``job``."""

    def __init__(self, ctx, spec: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, spec), daemon=True, name="moe_rl-reward")
        self.proc.start()
        child.close()
        self.spawned = time.monotonic()
        self.ready = False
        self.job: int | None = None  # the call it runs
        self.sent = 0.0  # when the parent sent it (parent clock)
        self.t0: float | None = None  # when the worker started it (its own stamp)

    def deadline(self, timeout_s: float) -> float:
        """When the parent must act: the end of the startup window, or the running call's time limit."""
        if not self.ready:
            return self.spawned + STARTUP_TIMEOUT_S
        if self.t0 is None:  # sent, start stamp not read yet: never judged on the parent's clock alone
            return self.sent + timeout_s + STARTUP_TIMEOUT_S
        return self.t0 + timeout_s

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardPool:
    """``num_workers`` processes running ``spec`` (``'pkg.module:fn'`` or ``'file.py:fn'``) with ``timeout_s``."""

    def __init__(self, spec: str, num_workers: int = 2, timeout_s: float = 30.0):
        self.spec, self.num_workers, self.timeout_s = spec, num_workers, timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []

    # ------------------------------------------------------------------ workers
    def _spawn(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.spec))

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker`` and spawn its replacement; returns at once (the new one says when it is ready)."""
        worker.kill()
        self._workers.remove(worker)
        self._spawn()

    def _load_failed(self, detail: str):
        named = detail if detail.startswith("reward.function") else f"reward.function={self.spec!r}: {detail}"
        return ValueError(named)

    def _receive(self, w: _Worker, out: list) -> None:
        """Read every message ``w`` has sent; a closed pipe is a dead worker (replaced)."""
        while w in self._workers and w.conn.poll():
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                if not w.ready:
                    w.kill()
                    self._workers.remove(w)
                    why = f"the worker exited with code {w.proc.exitcode} while importing it"
                    raise self._load_failed(why) from None
                if w.job is not None:
                    out[w.job] = Outcome(error=f"its worker process died (exit code {w.proc.exitcode})")
                self._replace(w)
                return
            kind = msg[0]
            if kind == "ready":
                w.ready = True
            elif kind == "load_error":
                w.kill()
                self._workers.remove(w)
                raise self._load_failed(msg[1])
            elif kind == "started":
                w.t0 = msg[2]
            elif kind == "done":
                _, index, result, error, elapsed = msg
                if error is None and elapsed >= self.timeout_s:
                    error = f"timed out after reward.timeout_s={self.timeout_s:g} s (it returned after {elapsed:.2f} s)"
                out[index] = Outcome(*result) if error is None else Outcome(error=error)
                w.job, w.t0 = None, None

    def _wait(self, out: list) -> None:
        """Wait for the next message or deadline, then act on both: read replies, kill overdue calls."""
        watched = [w for w in self._workers if not w.ready or w.job is not None]
        if not watched:
            return
        until = min(w.deadline(self.timeout_s) for w in watched)
        ready = wait([w.conn for w in watched], timeout=max(0.0, until - time.monotonic()))
        for w in watched:
            if w.conn in ready:
                self._receive(w, out)
        now = time.monotonic()
        for w in list(self._workers):
            if w.ready and w.job is None or now < w.deadline(self.timeout_s) or w.conn.poll():
                continue  # a reply that is already in the pipe is read on the next pass, never discarded
            if not w.ready:
                w.kill()
                self._workers.remove(w)
                raise RuntimeError(f"reward worker for {self.spec!r} did not start within {STARTUP_TIMEOUT_S:.0f} s")
            if w.job is not None:
                out[w.job] = Outcome(error=f"timed out after reward.timeout_s={self.timeout_s:g} s")
                self._replace(w)

    # ------------------------------------------------------------------ API
    def start(self) -> RewardPool:
        """Start the workers and wait until each has imported the function (ValueError if it cannot)."""
        self._spawn()
        while any(not w.ready for w in self._workers):
            self._wait([])
        return self

    def map(self, calls: list[dict]) -> list[Outcome]:
        """Run ``fn(**call)`` for every call; outcomes in call order (timeouts and crashes as errors)."""
        self.start()
        out: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        while pending or any(w.job is not None for w in self._workers):
            for w in list(self._workers):
                if w.ready and w.job is None and pending:
                    i = pending[0]
                    try:
                        w.conn.send((i, calls[i]))
                    except (BrokenPipeError, ConnectionError, OSError):  # died while idle: a fresh one takes the call
                        self._replace(w)
                        continue
                    pending.popleft()
                    w.job, w.sent, w.t0 = i, time.monotonic(), None
            self._wait(out)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        """Idle workers exit on their own; busy or still-importing ones are killed (nothing waits on them)."""
        for w in self._workers:
            if w.ready and w.job is None:
                try:
                    w.conn.send(None)
                    w.proc.join(2)
                except (OSError, ValueError):
                    pass
            w.kill()
        self._workers = []

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
