"""Issue 57 item 7: log lines go around the progress bar (not onto its line) and print once per job (rank 0).

Each case runs a fresh interpreter that installs ``moe_rl.console`` as ``moe-rl`` does, draws the trainer's bar
(``MetricsLogger``'s tqdm call) and logs through a ``moe_rl`` logger, reading back its real stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import logging, sys, warnings
    from tqdm import tqdm
    from moe_rl import console
    from moe_rl.console import EVERY_RANK
    if sys.argv[1] == "install":
        console.install()
    log = logging.getLogger("moe_rl.train.loop")
    bar = tqdm(total=3, desc="moe-rl", unit="step", dynamic_ncols=True)
    bar.update(1)
    log.warning("kl alarm: step 2 not trained on")
    log.warning("rank-local: my own file", extra=EVERY_RANK)
    log.error("error: something broke")
    warnings.warn("a library warning", UserWarning, stacklevel=1)
    bar.update(2)
    bar.close()
    """
)


def _stderr(mode: str, rank: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RANK"} | ({"RANK": rank} if rank is not None else {})
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def _line_starts(err: str, text: str) -> list[bool]:
    """For each occurrence of ``text``: does it start a line (after a newline or the bar's carriage return)?"""
    starts, at = [], err.find(text)
    while at != -1:
        starts.append(at == 0 or err[at - 1] in "\r\n")
        at = err.find(text, at + 1)
    return starts


def test_warnings_print_on_their_own_line_not_onto_the_progress_bar():
    """Break tried: without ``console.install`` (Python's fallback handler) the warning follows the bar's text on its
    line, which the check for the fallback below shows."""
    err = _stderr("install")
    assert _line_starts(err, "kl alarm: step 2") == [True], err
    assert _line_starts(err, "error: something broke") == [True], err
    assert "a library warning" in err
    # what tqdm.write does: the bar is redrawn after the line, so the last bar state is below every warning
    assert err.rfind("3/3") > err.find("error: something broke"), err


def test_without_the_console_a_warning_lands_on_the_bar_line():
    """The failure the console fixes, shown (so the check above can fail): the fallback handler appends to the bar."""
    err = _stderr("bare")
    at = err.find("kl alarm: step 2")
    assert at > 0 and err[at - 1] not in "\r\n", err


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_rank_other_than_0_prints_only_its_errors_and_its_own_warnings(rank):
    err = _stderr("install", rank)
    if rank == "0":
        assert "kl alarm: step 2" in err and "a library warning" in err and "[rank" not in err
        return
    assert "kl alarm: step 2" not in err and "a library warning" not in err, err  # rank 0 prints these
    assert "[rank 1] rank-local: my own file" in err
    assert "[rank 1] error: something broke" in err
