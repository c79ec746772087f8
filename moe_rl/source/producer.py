"""Where rank 0's records for an RL step come from: made inline (sync) or by a producer thread ahead (async).

Owns ``train.rollout_mode`` and ``train.max_staleness`` (docs/training.md, "sync -> async"). Both
sources call the same ``make(step, served_version, drawn) -> Path`` (the batch maker's: prompts, generation,
rewards, filters, ``rollouts/step_<s>.safetensors`` written before it is trained on; ``drawn()`` once the
step takes no more prompts); they differ only in *when*:

* ``InlineBatches`` (sync): ``batch(s)`` makes step ``s``'s records there and then, on version ``s``.
* ``AsyncProducer`` (async, k = ``max_staleness``): steps ``start, start+1, …`` are started in order, each on
  a thread of its own, so several can be in flight and a step's slow reply delays only that step (its
  records are written once it has all its samples; the learner trains steps in order). A step starts
  drawing prompts only once the step before has drawn all of its own (dynamic sampling's later rounds
  included), so prompts are taken in step order whatever the timing. The trainer runs it inside its rollout
  process (``moe_rl.source.rollout_worker``, driven from learner rank 0 by
  ``moe_rl.source.rollout_process``, which offers the loop the same interface).
  Admission: step ``t`` starts only once the served weights have version ``>= t - k`` (version ``v`` = the
  weights at the start of RL step ``v``), so no token it generates is more than ``k`` versions older than
  the weights that train it. ``exclusive()`` is what a weight push (``rollout.partial: false``) and an
  eval take: it waits for the batches in flight to finish and holds the producer back until it is left,
  so every sample of a batch comes from one version and an eval sees the version being trained. With
  ``k = 0`` step ``t`` starts only after version ``t`` is pushed: the same batches as sync, bitwise.

The producer never talks to other ranks: a re-sync its batch needs goes to learner rank 0 (the rollout
process asks; rank 0 runs it on every rank at its next wait, ``rank0_calls``). Its failure is re-raised at the
next ``batch()``. ``checkpoint_state(c)``
is what a checkpoint taken before step ``c`` must carry so a killed run loses no prompt and trains no
step twice: the finished-but-untrained records of steps ``c, c+1, …`` (the files themselves) and the
prompt-stream position before the first unfinished step (its prompts are taken again from there).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from moe_rl.data.loaders import DataError
from moe_rl.reward.scorer import RewardError
from moe_rl.rollout.health import run_may_pause
from moe_rl.rollout.partial import paused_generation

__all__ = ["AsyncProducer", "InlineBatches", "pending_records", "push_section", "raise_batch_failure"]

MakeBatch = Callable[[int, int, Callable[[], None]], Path]  # (step, served version, drawn) -> step's records file


def _user_errors() -> tuple[type, ...]:
    """Errors whose message is complete for the user (file and row, or function and sample): re-raised as they
    are, so the CLI prints one line (datasets are read when drawn, in the producer thread in async mode)."""

    return (DataError, RewardError)


def raise_batch_failure(step: int, error: BaseException, who: str):
    """Re-raise ``error`` (a batch source failed making the batch of step index ``step``) in the learner's thread: a
    bad dataset row or reward as it is (its one-line message), anything else naming the step (1-based, as metrics.jsonl
    counts) and ``who`` failed."""
    if isinstance(error, _user_errors()):
        raise error
    raise RuntimeError(f"{who} failed while making step {step + 1}'s batch: {type(error).__name__}: {error}") from error


class InlineBatches:
    """Sync mode: step ``s``'s records are made when the learner asks for them, on version ``s`` (a resumed
    async checkpoint's finished batches are trained first, as they were)."""

    mode = "sync"

    def __init__(self, make: MakeBatch, start_step: int, pending: dict[int, Path] | None = None):
        self.make, self.served, self.pending = make, start_step, dict(pending or {})

    def start(self) -> None:
        pass

    def batch(self, step: int) -> Path:
        return self.pending.pop(step) if step in self.pending else self.make(step, self.served, lambda: None)

    def weights_pushed(self, version: int) -> None:
        self.served = version

    @contextlib.contextmanager
    def exclusive(self, wait_for_batch: bool = True, serve: bool = False):
        yield

    def take_times(self) -> dict[str, float]:
        return {}

    def checkpoint_state(self, next_step: int) -> tuple[dict, dict[str, Path]]:
        return {}, {}

    def close(self) -> None:
        pass


class AsyncProducer:
    """Async mode: steps ``start … end-1`` made ahead of the learner, several at once (module docstring)."""

    mode = "async"

    def __init__(
        self,
        make: MakeBatch,
        start_step: int,
        end_step: int,
        max_staleness: int,
        served_version: int,
        stream_state: Callable[[], dict | None] = lambda: None,
        pending: dict[int, Path] | None = None,
    ):
        self.make, self.k = make, int(max_staleness)
        self.end = end_step
        self.served = int(served_version)
        self.stream_state = stream_state
        self.ready: dict[int, Path] = dict(pending or {})  # finished, not yet handed to the learner
        self.next = start_step
        while self.next in self.ready:  # a resumed run's finished batches are not made again
            self.next += 1
        self.data_before: dict[int, dict | None] = {}  # step -> stream position before its prompts were taken
        self._cond = threading.Condition()
        self._making: set[int] = set()  # the steps in flight
        self._drawing: int | None = None  # the step still taking prompts: the next one waits (prompts in step order)
        self._workers: list[threading.Thread] = []
        self._held = 0  # exclusive() sections waiting or running: the producer starts nothing meanwhile
        self._stop = False
        self._error: BaseException | None = None  # the first failure, and the step it failed on
        self._error_step = -1
        self._idle_s = 0.0  # time with no batch in flight, since the last take_times()
        self._idle_since: float | None = None  # since when no batch is in flight (start() sets it first)
        self._wait_s = 0.0  # learner time spent waiting for a batch, since the last take_times()
        self._thread = threading.Thread(target=self._run, name="moe_rl-rollout-producer", daemon=True)

    # ------------------------------------------------------------------ producer threads
    def start(self) -> None:
        with self._cond:  # idle counts from here
            self._idle_since = time.perf_counter()
        self._thread.start()

    def _admitted(self, step: int) -> bool:
        if self._stop or self._error is not None:
            return True
        return self._held == 0 and self._drawing is None and step - self.served <= self.k

    def _run(self) -> None:
        """Starts each admitted step on a thread of its own, in step order, once the step before has its prompts."""
        while True:
            with self._cond:
                step = self.next
                if step >= self.end:
                    return
                self._cond.wait_for(lambda step=step: self._admitted(step))
                if self._stop or self._error is not None:
                    return
                self.data_before[step] = self.stream_state()  # before make() takes the step's prompts
                if not self._making and self._idle_since is not None:
                    self._idle_s += time.perf_counter() - self._idle_since
                    self._idle_since = None
                self._making.add(step)
                self._drawing, served, self.next = step, self.served, step + 1
                worker = threading.Thread(
                    target=self._make_one, args=(step, served), daemon=True, name=f"moe_rl-rollout-step-{step}"
                )
                self._workers = [w for w in self._workers if w.is_alive()] + [worker]
            worker.start()

    def _drawn(self, step: int) -> None:
        """``step`` takes no more prompts: the next step may start drawing."""
        with self._cond:
            if self._drawing == step:
                self._drawing = None
                self._cond.notify_all()

    def _make_one(self, step: int, served: int) -> None:
        try:
            path = self.make(step, served, lambda: self._drawn(step))
        except BaseException as exc:  # noqa: BLE001 -- handed to the learner's thread at its next batch()
            with self._cond:
                if self._error is None:
                    self._error, self._error_step = exc, step
                self._finished(step)
            return
        with self._cond:
            self.ready[step] = path
            self._finished(step)

    def _finished(self, step: int) -> None:  # under self._cond
        self._making.discard(step)
        if self._drawing == step:
            self._drawing = None
        if not self._making:
            self._idle_since = time.perf_counter()
        self._cond.notify_all()

    # ------------------------------------------------------------------ learner thread
    def batch(self, step: int) -> Path:
        """Step ``step``'s records, once made (waiting is ``time/learner_wait_s``)."""
        t0 = time.perf_counter()
        with self._cond:
            # a later step's failure waits for this one, still in flight, to end (it may yet be trained)
            self._cond.wait_for(lambda: step in self.ready or (self._error is not None and step not in self._making))
            self._wait_s += time.perf_counter() - t0
            if step not in self.ready:
                raise_batch_failure(self._error_step, self._error, "the rollout producer")
            self.data_before.pop(step, None)
            return self.ready.pop(step)

    def weights_pushed(self, version: int) -> None:
        """The servers now hold ``version``: steps up to ``version + k`` may start."""
        with self._cond:
            self.served = int(version)
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, wait_for_batch: bool = True, serve: bool = False):
        """Wait for the batch in flight (``wait_for_batch``; a partial-rollout push pauses it instead; the wait counts
        in ``time/learner_wait_s``) and keep the producer from starting another while inside. ``serve`` is the
        batch sources' shared signature (``RolloutProcess`` serves rank 0's requested collectives while it waits);
        nothing in this producer's process asks for one."""
        t0 = time.perf_counter()
        with self._cond:
            self._held += 1
            try:
                self._cond.wait_for(lambda: not self._making or not wait_for_batch)
            except BaseException:
                self._held -= 1
                raise
            self._wait_s += time.perf_counter() - t0  # the learner waits for the batch in flight
        try:
            with run_may_pause():  # the trainer may pause the servers inside: the watchdog resumes none (health.py)
                yield
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    def take_times(self) -> dict[str, float]:
        """``time/learner_wait_s`` and ``time/rollout_idle_s`` (no batch in flight, counted up to now) since the
        last call."""
        with self._cond:
            now = time.perf_counter()
            if self._idle_since is not None:
                self._idle_s += now - self._idle_since
                self._idle_since = now
            out = {"time/learner_wait_s": self._wait_s, "time/rollout_idle_s": self._idle_s}
            self._wait_s = self._idle_s = 0.0
        return out

    def checkpoint_state(self, next_step: int) -> tuple[dict, dict[str, Path]]:
        """``(state, files)`` for a checkpoint taken before ``next_step`` (module docstring)."""
        with self._cond:
            steps, first_unfinished = [], next_step
            while first_unfinished in self.ready:
                steps.append(first_unfinished)
                first_unfinished += 1
            if first_unfinished in self.data_before:  # in flight: its prompts are taken again from here
                data = self.data_before[first_unfinished]
            else:  # not started: the stream has not moved past the finished steps
                data = self.stream_state()
            files = {f"step_{t:06d}.safetensors": self.ready[t] for t in steps}
        state = {"ready_steps": steps, "unfinished_from": first_unfinished, "served_version": self.served}
        return {"async": state, **({"data": data} if data is not None else {})}, files

    def close(self, join_s: float = 30.0) -> None:
        """Start nothing more; wait up to ``join_s`` for the batches in flight to end with their requests (the
        threads are daemons otherwise)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            threads = [self._thread, *self._workers]
        deadline = time.monotonic() + join_s
        for thread in threads:
            if join_s and thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def push_section(source, rollout, addresses, keys, before: Callable[[], None] = lambda: None):
    """Around a weight push (rank 0): ``rollout.partial: false`` waits for the batch in flight;
    ``true`` pauses it on the servers (``rollout.pause_mode``, ``moe_rl.rollout.partial``) and continues it
    under the new weights. Either way no new batch starts inside. ``before()`` runs once no new batch can start,
    before the pause (the restart of a dead server, which could not be paused). Yields the push's keyword arguments."""
    if not rollout.partial:
        with source.exclusive(serve=True):  # the other ranks wait in follow() until the push starts
            before()
            yield {}
        return

    with source.exclusive(wait_for_batch=False, serve=True):
        before()
        with paused_generation(addresses, rollout.pause_mode, keys) as window:
            yield {"flush_cache": window.flush_cache}


def pending_records(resume_meta: dict, records_dir: Path) -> dict[int, Path]:
    """``{step: path}`` of a resumed checkpoint's finished-but-untrained records, copied back to
    ``<records_dir>/step_<s>.safetensors`` (where the batch trained at step ``s`` lives)."""
    ready = resume_meta.get("extra", {}).get("async", {}).get("ready_steps", [])
    out = {}
    for step in ready:
        name = f"step_{int(step):06d}.safetensors"
        source = Path(resume_meta["files_dir"]) / name
        if not source.is_file():
            raise FileNotFoundError(
                f"{source}: the checkpoint lists step {int(step) + 1}'s finished records but does not "
                "hold them (a damaged checkpoint); start over or restore the file"
            )
        target = Path(records_dir) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{name}.resume.tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
        out[int(step)] = target
    return out
