"""Where a restarted rollout process starts (``moe_rl.source.rollout_restart``) and how a death is named.

The restart point is the learner's next step: the finished records from there on (contiguous) are handed to the new
process, every later step is made again from the prompt-stream position before the first unfinished one, so no step
is lost or made twice and no prompt is skipped or drawn twice.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from moe_rl.source.rollout_restart import RestartPoint, RolloutProcessError, death_line
from moe_rl.source.rollout_worker import send_crash


def _pos(i: int) -> dict:
    return {"epoch": 0, "index": i, "size": 100}


def test_a_new_process_gets_the_contiguous_finished_records_and_the_position_before_the_first_unfinished_step():
    point = RestartPoint(_pos(0))
    point.began(0, 0, {})
    ready = {}
    for step in range(4):  # steps 0..3 drew 8 prompts each; 0, 1 and 3 finished, 2 is in flight
        point.drawn(step, _pos(8 * (step + 1)))
    for step in (0, 1, 3):
        ready[step] = Path(f"step_{step:06d}.safetensors")
    ready.pop(0)
    point.taken(0)  # the learner trained step 0
    pending, position = point.resume(ready)
    assert pending == {1: Path("step_000001.safetensors")}
    assert position == _pos(16), "step 2's prompts are taken again from where step 1 left the stream"
    assert ready == pending, "step 3 (finished after the unfinished step 2) is made again, not trained as it was"
    assert point.next == 1


def test_a_restart_with_nothing_finished_starts_at_the_learners_next_step():
    point = RestartPoint(None)  # a built-in task: no stream position
    point.began(0, 0, {})
    point.drawn(0, None)
    point.taken(0)
    assert point.resume({}) == ({}, None)
    point.drawn(1, None)  # the new process's step 1 drew, then died again before finishing
    assert point.resume({}) == ({}, None)


def test_a_resumed_checkpoints_records_count_as_finished_and_the_position_is_after_them():
    point = RestartPoint(_pos(40))  # the checkpoint's position: before step 7, after its finished 5 and 6
    pending = {5: Path("a"), 6: Path("b")}
    point.began(5, 5, pending)
    ready = dict(pending)
    assert point.resume(ready) == (pending, _pos(40))
    ready.pop(5)
    point.taken(5)
    ready.pop(6)
    point.taken(6)
    assert point.resume(ready) == ({}, _pos(40))


def test_a_position_never_reported_refuses_the_restart_rather_than_rewinding_the_stream():
    point = RestartPoint(_pos(0))
    point.began(0, 0, {})
    point.taken(0)  # (a step handed over without its position: cannot happen through the pipe's order)
    with pytest.raises(RolloutProcessError, match="step 2"):
        point.resume({})


def test_a_death_is_named_by_its_signal_its_exit_code_or_its_error():
    assert death_line(7, -signal.SIGKILL, None) == "the rollout process (pid 7) died (killed by SIGKILL)"
    assert death_line(7, 1, None) == "the rollout process (pid 7) died (exit code 1)"
    assert death_line(7, 1, "ValueError: boom") == "the rollout process (pid 7) died (ValueError: boom)"


def test_an_error_that_kills_the_process_is_sent_in_one_line_and_its_traceback_logged(tmp_path):
    sent = []
    log = tmp_path / "logs" / "rollout_process.log"
    try:
        raise ValueError("row 3: bad\nsecond line")
    except ValueError as exc:
        send_crash(lambda *msg: sent.append(msg), str(log), exc)
    assert sent == [("crashed", f"ValueError: row 3: bad second line; traceback in {log}")]
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "test_an_error_that_kills" in text
