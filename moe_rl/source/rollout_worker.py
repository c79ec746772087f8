"""The rollout process of async mode: rank 0's prompts, generation, rewards and records, beside the learner.

Owns the child side of ``moe_rl.source.rollout_process``. Spawned by learner rank 0 (a fresh interpreter:
nothing of the learner's threads, GIL or process group state is shared), pinned to its cores, it builds the
prompt stream, the reward scorer, the eval sets and, once the servers are up (``begin``), the rollout client and
an ``AsyncProducer`` that makes steps ``start, start+1, …`` ahead of the learner, several at once (a thread
each, their requests sharing the client's slots), under the same admission rule as before
(``train.max_staleness``): prompts, generation (partial rollouts stitched by the
client), rewards, dynamic sampling, records written atomically to ``rollouts/step_<s>.safetensors``. Each
finished step is announced to the learner (``made``), and before it the prompt-stream position once the step has
drawn its prompts (``drawn``: where a process restarted by the learner takes the next step's prompts from); the
learner never decodes a reply. An error that kills the process is sent first in one line (``crashed``; its traceback
goes to ``WorkerSpec.log_path``).

What it cannot do itself it asks the learner for (``ask``): a re-sync of the servers (the weights live in the
learner: collective over every learner rank, run at rank 0's next wait) and a server restart (one supervisor,
``ServerPool``, in rank 0). The learner tells it every push (``pushed``: the version, for admission, and the
digests the served-weights check compares), holds it around a push or an eval (``hold``/``unhold``) and
asks it for its times, its checkpoint state and evals. Signals that end or checkpoint a run (SIGTERM, SIGUSR1,
SIGINT, SIGHUP) are the trainer's: this process ignores them and is closed by it; it dies with the trainer
(``PR_SET_PDEATHSIG`` and a parent watch), and its reward workers with it (their pipe closes).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from moe_rl.data import build_prompt_stream
from moe_rl.data.chat import load_tokenizer, stop_token_ids
from moe_rl.reward import build_rewarder
from moe_rl.rollout.client import RolloutClient
from moe_rl.sync.checks import check_servable
from moe_rl.sync.integrity import version_label
from moe_rl.sync.served_weights import PushedWeights

__all__ = ["BatchRestarts", "PromptSide", "WorkerSpec", "portable_error", "send_crash", "worker_main"]

_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")


@dataclass
class WorkerSpec:
    """What the rollout process is started with (pickled once, through the spawn pipe)."""

    cfg: object  # ExperimentConfig
    run_id: str
    nonce: str
    records_dir: str
    data_state: dict | None  # the checkpoint's prompt-stream position
    cpus: list[int]  # [] = the trainer's affinity
    parent_pid: int
    log_path: str = ""  # where an error that kills the process leaves its traceback (the trainer prints one line)


@dataclass
class PromptSide:
    """Rank 0's tokenizer, prompt stream, reward scorer, step samples and evaluator (the sync trainer's too)."""

    tokenizer: object
    prompts: object
    rewarder: object
    samples: object
    evaluator: object

    @classmethod
    def build(cls, cfg, data_state: dict | None) -> PromptSide:
        from moe_rl.source.step_samples import StepSamples  # noqa: PLC0415  imported after worker_main's pinning

        tokenizer = load_tokenizer(cfg) if cfg.data is not None else None  # the built-in tasks: task ids
        prompts = build_prompt_stream(cfg, tokenizer)
        prompts.load_state(data_state)
        rewarder = build_rewarder(cfg, tokenizer)
        evaluator = None
        if cfg.eval is not None:
            from moe_rl.source.evaluate import Evaluator  # noqa: PLC0415  imported after worker_main's pinning

            evaluator = Evaluator(cfg, tokenizer, rewarder, prompts)
        return cls(tokenizer, prompts, rewarder, StepSamples(cfg, prompts, rewarder), evaluator)

    def stop_tokens(self, cfg) -> dict:
        """Dataset prompts: responses end at the tokenizer's EOS ids (the built-in tasks: the server's default)."""

        return {"stop_token_ids": stop_token_ids(self.tokenizer, cfg.model.hf_path)} if self.tokenizer else {}


def portable_error(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (a DataError keeps its one-line message), else a RuntimeError naming it."""

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 -- any unpicklable exception
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _ServedView:
    """The learner's record of what the servers hold, as the batch maker checks it (``WeightSync``'s two checks)."""

    def __init__(self, keys):
        self.invalid: dict[str, str] = {}
        self.pushed = PushedWeights(keys)

    def update(self, state: dict) -> None:
        self.invalid = dict(state["invalid"])
        if state.get("label") and state.get("digests") is not None:
            self.pushed.remember(state["label"], state["digests"])

    def check_servable(self, addresses) -> None:
        check_servable(self.invalid, addresses)


class BatchRestarts:
    """Restarts asked for by the batches in flight, each knowing the restarts made since it started.

    ``ask(urls, seen) -> (restarted URLs, restarts now)`` is rank 0's ``ServerPool.restart_since``. A batch whose
    request failed on a server that another batch (or rank 0's push) restarted meanwhile gets that server back
    and re-syncs, rather than a refusal: so each batch (one thread each) counts from what it knew at its start,
    not from the process's last answer."""

    def __init__(self, ask):
        self.ask, self.known = ask, 0
        self._batch = threading.local()

    def start_batch(self) -> None:
        self._batch.seen = self.known

    def __call__(self, urls=None) -> list[str]:
        restarted, self._batch.seen = self.ask(urls, getattr(self._batch, "seen", self.known))
        self.known = max(self.known, self._batch.seen)
        return restarted


class _Worker:
    def __init__(self, conn, spec: WorkerSpec):
        from moe_rl.source.step_records import StepRecords  # noqa: PLC0415  imported after worker_main's pinning

        self.conn, self.spec, self.cfg = conn, spec, spec.cfg
        self.side = PromptSide.build(spec.cfg, spec.data_state)
        self.records = StepRecords.for_trainer(spec.cfg, spec.run_id)
        self.client = self.maker = self.producer = self.view = None
        self._send_lock, self._asks, self._ids = threading.Lock(), {}, iter(range(1 << 62))
        self._holds: list[contextlib.ExitStack] = []
        self.restarts = BatchRestarts(lambda urls, seen: self.ask("restart", urls, seen))

    # ------------------------------------------------------------------ messages
    def send(self, *msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def ask(self, name: str, *args):
        """Have the learner run ``name`` (``resync``, ``restart``) and wait for its answer."""
        req, done = next(self._ids), threading.Event()
        self._asks[req] = box = {"done": done}
        self.send("ask", req, name, args)
        done.wait()
        if box.get("error") is not None:
            raise box["error"]
        return box.get("value")

    def serve(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "close":
                return
            getattr(self, f"_on_{msg[0]}")(*msg[1:])

    def _reply(self, req: int, fn, *args) -> None:
        try:
            value, err = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 -- handed to the learner, which raises it
            value, err = None, portable_error(exc)
        self.send("reply", req, err, value)

    def _in_thread(self, req: int, fn, *args) -> None:
        threading.Thread(target=self._reply, args=(req, fn, *args), daemon=True).start()

    # ------------------------------------------------------------------ the learner's calls
    def _on_reply(self, req: int, err, value) -> None:
        box = self._asks.pop(req)
        box["error"], box["value"] = err, value
        box["done"].set()

    def _on_begin(self, req: int, addresses, keys, start: int, served: int, pending: dict, state) -> None:
        self._reply(req, self._begin, addresses, keys, start, served, pending, state)

    def _begin(self, addresses, keys, start: int, served: int, pending: dict, state) -> None:
        from moe_rl.source.batch_maker import BatchMaker  # noqa: PLC0415  imported after worker_main's pinning
        from moe_rl.source.producer import AsyncProducer  # noqa: PLC0415  imported after worker_main's pinning

        cfg = self.cfg
        self.view = _ServedView(keys)
        if state is not None:
            self.view.update(state)
        self.client = RolloutClient.from_config(
            cfg, addresses, headers=keys.headers(), admin_headers=keys.headers(admin=True), **self.side.stop_tokens(cfg)
        )
        self.maker = BatchMaker(
            cfg,
            self.side.samples,
            self.records,
            Path(self.spec.records_dir),
            self.client,
            lambda s: version_label(s, self.spec.nonce),
            resync=self._resync,
            weight_sync=lambda: self.view if self.view.pushed.by_label else None,
            restart=self.restarts,
        )
        self.producer = AsyncProducer(
            self._make,
            start,
            cfg.train.steps,
            cfg.train.max_staleness,
            served,
            self.side.prompts.state,
            {int(s): Path(p) for s, p in pending.items()},
        )

    def _make(self, step: int, served: int, drawn) -> Path:
        """The producer's ``make``: the batch maker's records, announced to the learner (or its failure). Once the
        step has drawn its prompts the learner is told the stream's position (where a restarted process would take
        the next step's prompts from), before the next step may draw."""
        self.restarts.start_batch()  # on the step's own thread
        told = []

        def drawn_once() -> None:
            if not told:
                told.append(True)
                self.send("drawn", step, self.side.prompts.state())
                drawn()

        try:
            path = self.maker(step, served, drawn_once)
            drawn_once()  # (before "made": the learner knows the position after every step it is handed)
        except BaseException as exc:
            self.send("failed", step, portable_error(exc))
            raise
        self.send("made", step, str(path))
        return path

    def _resync(self, served: int) -> int | None:
        """The learner's re-sync; the version it pushed (the learner's weights then: maybe newer than ``served``)."""
        state = self.ask("resync", served)
        if state is None:
            return None
        self.view.update(state)
        return state.get("version")

    def _on_start(self) -> None:
        self.producer.start()

    def _on_pushed(self, req: int, version: int, state) -> None:
        def pushed():
            if state is not None:
                self.view.update(state)
            self.producer.weights_pushed(version)

        self._reply(req, pushed)

    def _on_hold(self, req: int, wait_for_batch: bool) -> None:
        def hold():  # waits for the batch in flight (whose re-sync the learner serves meanwhile)
            stack = contextlib.ExitStack()
            stack.enter_context(self.producer.exclusive(wait_for_batch=wait_for_batch))
            self._holds.append(stack)

        self._in_thread(req, hold)

    def _on_unhold(self) -> None:
        self._holds.pop().close()

    def _on_eval(self, req: int, step: int, version: str) -> None:
        self._in_thread(req, self.side.evaluator.run, self.client, step, version)

    def _on_times(self, req: int) -> None:
        self._reply(req, self.producer.take_times)

    def _on_state(self, req: int, next_step: int) -> None:
        def state():
            extra, files = self.producer.checkpoint_state(next_step)
            return extra, {name: str(path) for name, path in files.items()}

        self._reply(req, state)

    def close(self) -> None:
        if self.producer is not None:  # its thread is a daemon: a batch in flight is dropped with the process
            self.producer.close(join_s=0)
        self.side.rewarder.close()


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the trainer dies (the kernel's parent-death signal; the trainer's main thread spawned us), and
    a watch for the case where it died before that was set."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="moe_rl-rollout-parent-watch", daemon=True).start()


def worker_main(conn, spec: WorkerSpec) -> None:
    """The rollout process's entry point (``multiprocessing`` spawn target)."""
    for name in _SIGNALS:  # the trainer decides when a run stops and closes this process
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    _die_with_parent(spec.parent_pid)
    try:
        if spec.cpus:
            try:
                os.sched_setaffinity(0, spec.cpus)
            except OSError as err:
                raise ValueError(
                    f"rollout.process_cpus={spec.cpus}: cannot pin the rollout process there ({err}); "
                    f"expected cores of {sorted(os.sched_getaffinity(0))}"
                ) from None
        worker = _Worker(conn, spec)
    except BaseException as exc:  # noqa: BLE001 -- a bad dataset or reward: the trainer raises it
        conn.send(("failed", None, portable_error(exc)))
        return
    conn.send(("ready",))
    try:
        worker.serve()
    except BaseException as exc:  # noqa: BLE001 -- the trainer names it in one line; the traceback goes to the log
        send_crash(worker.send, spec.log_path, exc)
        worker.close()
        sys.exit(1)  # (no traceback on the trainer's console)
    worker.close()


def send_crash(send, log_path: str, exc: BaseException) -> None:
    """Tell the trainer (``send``) the error that kills the process in one line, its last (and where its traceback
    is: appended to ``log_path``)."""
    line = " ".join(part.strip() for part in traceback.format_exception_only(exc)[-1].splitlines() if part.strip())
    if log_path:
        with contextlib.suppress(OSError):
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a") as log:
                log.write(f"rollout process {os.getpid()} died at {time.strftime('%Y-%m-%d %H:%M:%S')}:\n")
                log.write("".join(traceback.format_exception(exc)))
            line = f"{line}; traceback in {log_path}"
    with contextlib.suppress(OSError):
        send("crashed", line)
