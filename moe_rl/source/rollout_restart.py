"""Where a restarted rollout process starts, and how the death of one is named in the log.

Owns the learner's record of what the async rollout process (``moe_rl.source.rollout_process``) has handed over:
the next step the learner takes, the version the servers hold, and the prompt-stream position before each step not
yet drawn (the process reports each step's position once the step has drawn its prompts). A process that dies is
replaced by one that starts at the learner's next step: the finished records not yet trained (contiguous from that
step) are handed to it as they are, and every later step is made again from the position before the first
unfinished one, so no step is lost or made twice and no prompt is skipped or taken twice. Also the one line that
names a death (``death_line``) and the error that ends a run on one (``RolloutProcessError``).
"""

from __future__ import annotations

import signal
from pathlib import Path

__all__ = ["RestartPoint", "RolloutProcessError", "death_line"]


class RolloutProcessError(RuntimeError):
    """The rollout process died and is not started again (its message is the one line the CLI prints)."""


def death_line(pid: int | None, exitcode: int | None, crash: str | None) -> str:
    """``the rollout process (pid N) died (killed by SIGKILL)``, or with its exit code, or its error's last line."""
    if crash:
        why = crash
    elif exitcode is not None and exitcode < 0:
        try:
            why = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            why = f"killed by signal {-exitcode}"
    elif exitcode is not None:
        why = f"exit code {exitcode}"
    else:
        why = "its pipe closed"
    return f"the rollout process (pid {pid}) died ({why})"


class RestartPoint:
    """The learner side's record of the process's progress (module docstring)."""

    def __init__(self, data_state: dict | None):
        self.next = 0  # the step the learner takes next
        self.served = 0  # the version the servers hold (the last push)
        self.before: dict[int, dict | None] = {}  # step -> prompt-stream position before its prompts
        self._initial = data_state  # the position the first process starts from (a checkpoint's, or None)

    def began(self, start: int, served: int, pending: dict[int, Path]) -> None:
        """The process makes the steps from ``start`` not in ``pending`` (a resumed checkpoint's finished records),
        the first of them from the position it was started with."""
        self.next, self.served = int(start), int(served)
        first = self.next
        while first in pending:
            first += 1
        self.before = {first: self._initial}

    def drawn(self, step: int, position: dict | None) -> None:
        """``step`` has taken all of its prompts: ``position`` is the stream's before step ``step + 1``."""
        self.before[int(step) + 1] = position

    def taken(self, step: int) -> None:
        """The learner has taken ``step``'s records."""
        self.next = int(step) + 1
        for s in [s for s in self.before if s < self.next]:
            del self.before[s]

    def resume(self, ready: dict[int, Path]) -> tuple[dict[int, Path], dict | None]:
        """For a new process: ``(pending, position)``, the finished records it is handed (those of the steps from the
        learner's next one on, contiguous) and the prompt-stream position before the first step it makes. ``ready``
        (the learner's finished-not-taken records) keeps only those: later steps are made again."""
        first = self.next
        while first in ready:
            first += 1
        if first not in self.before:  # every step before it was drawn by a process that reported it, or is pending
            raise RolloutProcessError(
                f"the rollout process cannot be restarted at step {first + 1}: the prompt-stream position before it "
                "was never reported"
            )
        for s in [s for s in ready if not self.next <= s < first]:
            del ready[s]
        position = self.before[first]
        self.before = {first: position}
        return dict(ready), position
