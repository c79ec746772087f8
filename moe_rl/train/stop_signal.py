"""Stop at a step boundary on SLURM's advance warning (``launch.signal``), so a requeued job loses no step.

Owns the handler of the warning signal (``#SBATCH --signal=B:USR1@<launch.signal_lead_s>`` reaches the
learner through the launch script, ``srun`` and ``torchrun --signals-to-handle``): it only sets a flag.
A rank gets the warning more than once -- ``srun`` has slurmstepd signal every process of the step, and
``torchrun`` forwards the same signal to its workers again -- so a repeat is the same warning, not a
request to exit at once (the hard stop is torchrun's ``--shutdown-timeout``, then SLURM's own kill). At the end of every step the ranks agree whether any
of them was signalled (one all-reduce of a 0/1 flag, so every rank stops after the same step); the
loop then writes a checkpoint and ``moe-rl train`` exits with ``REQUEUE_EXIT_CODE``, which the launch
script (and a user's own sbatch script) turns into ``scontrol requeue``. Megatron-LM's
``DistributedSignalHandler`` (``--exit-signal-handler``) does the same with an all-gather.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later" -- stopped cleanly, a checkpoint is written


class StopRequest:
    """The warning signal's flag: ``installed()`` arms the handler, ``agreed()`` is the ranks' verdict."""

    def __init__(self, signame: str | None):
        self.signum = getattr(signal, f"SIG{signame}") if signame else None
        self.received: int | None = None  # the signal that arrived on this rank
        self.stopped_after: int | None = None  # the step the run stopped after (set by the loop)

    @classmethod
    def for_config(cls, cfg) -> StopRequest:
        return cls(cfg.launch.signal)

    def _handler(self, signum, _frame) -> None:
        if self.received is not None:  # the same warning again (slurmstepd's copy and torchrun's forward)
            return
        self.received = signum
        print(
            f"moe_rl: got {signal.Signals(signum).name}: finishing the step in progress, then checkpoint and stop",
            file=sys.stderr,
            flush=True,
        )

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Arm the handler (main thread only; elsewhere Python cannot take signals) until the block ends."""
        if self.signum is None or threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(self.signum, self._handler)
        try:
            yield self
        finally:
            signal.signal(self.signum, previous)

    def agreed(self) -> bool:
        """Whether any rank was signalled (collective when torch.distributed is initialised: every rank calls it)."""
        flag = self.received is not None

        if dist.is_available() and dist.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t.item())
        return flag
