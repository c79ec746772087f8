"""Guards of one run directory: one trainer at a time, writable paths, the resume rules applied, completed runs.

Owns the exclusive locks ``<train.output_dir>/.moe_rl.lock`` and ``<checkpoint.dir>/.moe_rl.lock`` (an
``flock`` each, held for the whole run; the file names the holder's PID and host, and a lock left by a
dead process is simply taken over, with a log line naming it), the check that ``train.output_dir`` and
``checkpoint.dir`` are writable, and the application of the rules for a directory that already holds a run
(the rules themselves, and ``RunDirError``: ``moe_rl.train.resume_rules``).

In a multi-rank job rank 0 does all of this and broadcasts the outcome, so every rank fails the same
way. Writing ``config.yaml`` is the trainer's job, after these checks and the checkpoint load passed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch

from moe_rl.learner.dist import decided_by_rank0
from moe_rl.learner.reference import ReferencePolicy, reference_problem
from moe_rl.train.resume_rules import RunDirError, check_resume

logger = logging.getLogger(__name__)

LOCK_FILE = ".moe_rl.lock"


# ---------------------------------------------------------------------------------------------- lock
@dataclass
class RunLock:
    """An ``flock`` on ``<run_dir>/.moe_rl.lock``; released by ``release()`` or when the process dies."""

    path: Path
    fd: int | None = None
    key: str = "train.output_dir"  # the config key of the locked directory (named in the error)

    @staticmethod
    def holder_text(path: Path) -> str:
        with contextlib.suppress(OSError, ValueError):
            h = json.loads(path.read_text())
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"]))
            return f"pid {h['pid']} on host {h['host']} (since {since})"
        return "an unknown process"

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirError(
                f"{self.key}={self.path.parent} is in use by another trainer: {self.holder_text(self.path)} "
                f"holds {self.path}. Wait for it to end (or stop it), or set another {self.key}"
            ) from None
        previous = os.read(fd, 4096).decode(errors="replace").strip()
        if previous:  # the holder died without releasing: the kernel dropped its flock
            logger.warning(
                "taking over the stale lock %s left by %s (no longer running)", self.path, self.holder_text(self.path)
            )
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        """Clear the holder record and drop the lock (the file stays: unlinking would race a waiter)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> Self:
        return self.acquire() if self.fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


# ------------------------------------------------------------------------------------- writability
def check_writable(paths: dict[str, Path]) -> None:
    """Create each directory and a file in it; RunDirError naming the config key on the first failure."""
    for key, path in paths.items():
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=path, prefix=".write-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, "error")
            raise RunDirError(
                f"{key}={path} is not writable: {exc.strerror or exc} ({name}); checked before starting so no "
                f"step is lost at the first save: fix the permissions or set another {key}"
            ) from None


# ------------------------------------------------------------------------------------ entry point
@dataclass
class RunLocks:
    """The locks of one run (output dir, checkpoint dir), released together."""

    locks: list[RunLock]

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()


def guard_run_dir(cfg, run_dir: str | Path, ckpt_dir: str | Path, rank: int = 0) -> RunLocks | None:
    """Lock, writability and resume rules for a run about to start (collective in multi-rank jobs).

    Rank 0 takes the locks of ``train.output_dir`` and ``checkpoint.dir`` (returned; the caller releases
    them at the end of the run) and checks; the outcome is broadcast so every rank raises the same
    RunDirError. Call before anything is written.
    """
    run_dir, ckpt_dir = Path(run_dir), Path(ckpt_dir)
    lock, error = None, None
    if rank == 0:
        lock = RunLocks([])
        try:
            check_writable({"train.output_dir": run_dir, "checkpoint.dir": ckpt_dir})
            lock.locks.append(RunLock(run_dir / LOCK_FILE).acquire())
            if ckpt_dir.resolve() != run_dir.resolve():
                lock.locks.append(RunLock(ckpt_dir / LOCK_FILE, key="checkpoint.dir").acquire())
            check_resume(cfg, run_dir, ckpt_dir)
        except RunDirError as exc:
            error = str(exc)
            lock.release()
            lock = None
    error = decided_by_rank0(lambda: error)  # every rank raises rank 0's outcome
    if error is not None:
        raise RunDirError(error)
    return lock


def run_complete_message(start_step: int, total_steps: int) -> str | None:
    """The line a finished run prints instead of starting servers (None when there are steps to do)."""
    if start_step >= total_steps:
        return f"nothing to do (run complete at step {start_step}; train.steps={total_steps})"
    return None


def reference_policy(cfg, learner, ckpt_dir: Path, run_id: str, resumed: bool):
    """π_ref for ``loss.kl_coef > 0``: the weights at the start of RL; on resume this run's saved
    reference or nothing (never rebuilt from the resumed weights). Rank 0 decides, all ranks follow."""

    offload = torch.cuda.is_available()
    if not resumed:
        return ReferencePolicy.from_learner(cfg, learner.module, offload=offload)
    problem = decided_by_rank0(lambda: reference_problem(ckpt_dir, run_id))
    if problem is not None:
        raise RunDirError(
            f"cannot resume checkpoint.dir={ckpt_dir} with loss.kl_coef={cfg.loss.kl_coef}: {problem}. "
            "The KL anchor is the policy at the start of RL and is not rebuilt from trained weights; start "
            "over with checkpoint.resume=never checkpoint.overwrite=true (or set loss.kl_coef=0)"
        )
    return ReferencePolicy.load(cfg, ckpt_dir, offload=offload)
