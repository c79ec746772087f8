"""What the terminal shows of a ``moe-rl`` command: log lines around the progress bar, once per job; a stop signal.

Owns the root logging handler that ``cli.main`` installs (``install``), and ``Terminated``:

* **Around the bar.** Every record goes out through ``tqdm.write``, which clears the progress bar, prints the line
  and draws the bar again below it; Python's fallback handler would print onto the bar's line. ``warnings.warn``
  goes the same way (``logging.captureWarnings``).
* **Once per job.** With several ranks every rank runs the same code and would print the same warning once each.
  A rank other than 0 prints only its errors and the warnings marked as its own (``extra=EVERY_RANK``: what differs
  by rank, e.g. a file only that rank reads), prefixed with ``[rank N]``. The rank is ``torch.distributed``'s once
  it is initialised, else torchrun's ``RANK``.
* **A stop signal.** SIGTERM and SIGHUP (``kill``'s default, a closed terminal) are raised in the main thread as
  ``Terminated``, a ``SystemExit(128 + signum)``: the ``finally`` blocks on the way out stop the servers and release
  the lock; ``cli.main`` ends with one line, as for Ctrl-C, and a program that embeds the server pool exits with
  ``128 + signum`` and no traceback, as a process killed by the signal would (``raise_terminated`` is the handler).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from tqdm import tqdm

__all__ = ["EVERY_RANK", "RankFilter", "Terminated", "TqdmHandler", "install", "raise_terminated"]

EVERY_RANK = {"every_rank": True}  # logger.warning(..., extra=EVERY_RANK): printed on every rank that logs it


class Terminated(SystemExit):
    """A stop signal (SIGTERM, SIGHUP) raised as ``SystemExit(128 + signum)``; ``signum`` is which."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def raise_terminated(signum: int, _frame) -> None:
    """The signal handler: raise ``Terminated(signum)`` in the main thread."""
    raise Terminated(signum)


def this_rank() -> int:
    """``torch.distributed``'s rank once initialised (a command that never imports torch has rank 0), else ``RANK``."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


class RankFilter(logging.Filter):
    """Rank 0 keeps every record; another rank its errors and ``EVERY_RANK`` records, prefixed ``[rank N]``."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = this_rank()
        if rank == 0:
            return True
        if record.levelno < logging.ERROR and not getattr(record, "every_rank", False):
            return False
        record.rank_prefix = f"[rank {rank}] "
        return True


class TqdmHandler(logging.Handler):
    """Writes each formatted record with ``tqdm.write`` to stderr (the bar is cleared and redrawn around it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(f"{getattr(record, 'rank_prefix', '')}{self.format(record)}", file=sys.stderr)
        except Exception:  # noqa: BLE001 -- logging's Handler protocol: handleError reports it
            self.handleError(record)


def install(level: int = logging.WARNING) -> TqdmHandler:
    """The root logger's handler for a command's process (replacing one installed before); returns it."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, TqdmHandler)]:
        root.removeHandler(old)
    handler = TqdmHandler(level)
    handler.setFormatter(logging.Formatter("%(message)s"))  # what Python's fallback handler printed
    handler.addFilter(RankFilter())
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > level:
        root.setLevel(level)
    logging.captureWarnings(True)
    return handler
