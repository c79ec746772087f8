"""Rank 0's calls (``moe_rl/train/rank0_calls.py``) on one process: a call from the main thread runs at once; one from
another thread waits for the main thread's ``serve()`` (never runs on that thread), and a closing trainer fails it
instead of leaving it waiting. The collective side (``follow`` on the other ranks) runs in the 2-rank restart test
(tests/train/test_multirank_launch.py)."""

from __future__ import annotations

import threading

import pytest

from moe_rl.train.rank0_calls import Rank0Calls


def test_a_call_from_another_thread_runs_on_the_main_thread_when_served():
    ran = []
    calls = Rank0Calls({"resync": lambda arg: ran.append((arg, threading.current_thread() is threading.main_thread()))})
    calls.call("resync", 1)
    worker = threading.Thread(target=calls.call, args=("resync", 2))
    worker.start()
    worker.join(timeout=0.3)
    assert worker.is_alive() and ran == [(1, True)], "a call from another thread ran without the main thread"
    assert calls.pending
    calls.serve()
    worker.join(timeout=10)
    assert not worker.is_alive() and ran == [(1, True), (2, True)] and not calls.pending


def test_a_request_left_unserved_when_the_trainer_closes_fails_instead_of_waiting():
    calls, errors = Rank0Calls({"resync": lambda arg: None}), []

    def ask():
        with pytest.raises(RuntimeError, match="closing") as info:
            calls.request("resync")
        errors.append(info.value)

    worker = threading.Thread(target=ask)
    worker.start()
    while not calls.pending:
        threading.Event().wait(0.01)
    calls.cancel("the trainer is closing; the re-sync was not run")
    worker.join(timeout=10)
    assert not worker.is_alive() and len(errors) == 1


def test_on_rank0_runs_the_work_on_the_only_rank_and_returns_its_result():
    """One process is rank 0: ``on_rank0`` runs the work there (no broadcast) and hands back its result."""
    calls = Rank0Calls({})
    assert calls.on_rank0(lambda: {"eval/x": 1.0}) == {"eval/x": 1.0}
