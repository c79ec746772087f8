"""A pool of reward worker processes with a per-call timeout the pool itself enforces.

Owns the workers: each is a spawned process (a fresh interpreter: nothing of the learner's threads or
process groups is inherited) that imports the reward function once and then runs one call at a time
in its main thread (math-verify's SIGALRM timeouts work there). The parent hands calls to idle
workers, and a call that runs longer than ``timeout_s`` has its worker killed and replaced: a hung
reward never blocks training and never leaks its time into the next call's budget. Outcomes come
back in call order as ``Outcome(value | error)``; what an error means is the caller's decision.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait

__all__ = ["Outcome", "RewardPool"]

STARTUP_TIMEOUT_S = 300.0  # importing a reward module (sympy for math-verify) on a loaded machine


@dataclass
class Outcome:
    """One call's result: ``score`` and the other numeric keys it returned, or ``error`` (a sentence)."""

    score: float = 0.0
    extras: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def _normalise(value) -> tuple[float, dict[str, float]]:
    """A float, or a dict with ``score``; NaN/inf or anything else raises ValueError."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys {sorted(value)})")
        extras = {str(k): float(v) for k, v in value.items()
                  if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ValueError(f"returned {type(value).__name__}; expected a float or a dict with 'score'")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score ({score})")
    return score, extras


def _worker(conn, spec: str) -> None:
    """Worker main loop: load ``spec``, say ready, then answer ``(index, kwargs)`` calls until None."""
    try:
        from moe_rl.reward.custom import load_function

        fn = load_function(spec)
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which raises it
        conn.send(("load_error", f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        index, kwargs = msg
        try:
            value = fn(**kwargs)
        except Exception as exc:  # noqa: BLE001 -- the reward's failure is data for the parent
            conn.send((index, None, f"raised {type(exc).__name__}: {exc}"))
            continue
        try:
            conn.send((index, _normalise(value), None))
        except ValueError as exc:
            conn.send((index, None, str(exc)))


class _Worker:
    def __init__(self, ctx, spec: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, spec), daemon=True, name="moe_rl-reward")
        self.proc.start()
        child.close()
        self.job: tuple[int, float] | None = None  # (call index, start time)
        self.ready = False

    def wait_ready(self, spec: str) -> None:
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"reward worker for {spec!r} did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            kind, detail = self.conn.recv()
        except EOFError:
            kind, detail = "load_error", f"the worker exited with code {self.proc.exitcode} while importing it"
        if kind != "ready":
            self.kill()
            raise ValueError(detail if detail.startswith("reward.function") else f"reward.function={spec!r}: {detail}")

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

    def start(self) -> RewardPool:
        """Start the workers and wait until each has imported the function (ValueError if it cannot)."""
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.spec))
        for w in self._workers:
            if not w.ready:
                w.wait_ready(self.spec)
                w.ready = True
        return self

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)
        fresh = _Worker(self._ctx, self.spec)
        fresh.wait_ready(self.spec)
        fresh.ready = True
        self._workers.append(fresh)

    def map(self, calls: list[dict]) -> list[Outcome]:
        """Run ``fn(**call)`` for every call; outcomes in call order (timeouts and crashes as errors)."""
        self.start()
        out: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        while pending or any(w.job for w in self._workers):
            for w in list(self._workers):
                if w.job is None and pending:
                    i = pending.popleft()
                    try:
                        w.conn.send((i, calls[i]))
                    except (BrokenPipeError, ConnectionError):  # it died while idle: a fresh one takes the call
                        pending.appendleft(i)
                        self._replace(w)
                        continue
                    w.job = (i, time.monotonic())
            busy = [w for w in self._workers if w.job]
            deadline = min(w.job[1] for w in busy) + self.timeout_s
            ready = wait([w.conn for w in busy], timeout=max(0.0, deadline - time.monotonic()))
            for w in busy:
                i, start = w.job
                if w.conn in ready:
                    try:
                        _, result, error = w.conn.recv()
                    except EOFError:
                        out[i] = Outcome(error=f"its worker process died (exit code {w.proc.exitcode})")
                        w.job = None
                        self._replace(w)
                        continue
                    out[i] = Outcome(*result) if error is None else Outcome(error=error)
                    w.job = None
                elif time.monotonic() - start >= self.timeout_s:
                    out[i] = Outcome(error=f"timed out after reward.timeout_s={self.timeout_s:g} s")
                    w.job = None
                    self._replace(w)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
            w.proc.join(2)
            w.kill()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
