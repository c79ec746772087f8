"""Issue 39: the learner's handler of SLURM's warning signal (launch.signal): a flag, then a step-boundary verdict
every rank shares."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_rl.learner.dist import free_port
from moe_rl.train.stop_signal import StopRequest


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # Python runs the handler between bytecodes of the main thread


def test_the_warning_sets_the_flag_and_a_repeat_of_it_changes_nothing():
    """Under srun + torchrun every rank gets the warning twice (slurmstepd signals every process of the step, then
    torchrun forwards it): the second copy must not end the rank mid-step (CI run of stop 41: it did, the other
    rank died on a closed gloo pair and no checkpoint was written)."""
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopRequest("USR1")
    with stop.installed():
        assert not stop.agreed()
        _deliver(signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1 and stop.agreed()
        _deliver(signal.SIGUSR1)  # raised SystemExit(138) before
        assert stop.received == signal.SIGUSR1 and stop.agreed()
    assert signal.getsignal(signal.SIGUSR1) == before  # the previous handler is back


def test_no_warning_configured_installs_no_handler():
    before = signal.getsignal(signal.SIGUSR2)
    with StopRequest(None).installed() as stop:
        assert signal.getsignal(signal.SIGUSR2) == before and not stop.agreed()


def _rank(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    stop = StopRequest("USR1")
    with stop.installed():
        verdicts = [stop.agreed()]
        if rank == 1:  # only rank 1 is signalled (a node that got the warning first)
            _deliver(signal.SIGUSR1)
        verdicts.append(stop.agreed())
    results[rank] = verdicts
    dist.destroy_process_group()


@pytest.mark.distributed
def test_ranks_stop_after_the_same_step_when_only_one_was_signalled():
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(free_port(), results), nprocs=2, join=True)
    assert dict(results) == {0: [False, True], 1: [False, True]}
