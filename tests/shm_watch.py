"""The suite leaves nothing in ``/dev/shm``: the session-end check (hooks imported by ``tests/conftest.py``).

A server that dies without cleaning up leaves files in ``/dev/shm`` (SGLang's ``sglang_loads_*.shm``, semaphores)
that fill the tmpfs of a shared host run after run. At the session's start the check notes what ``/dev/shm`` holds;
after each test, which new entries appeared during it; at the session's end -- every fixture torn down, every
server of the suite stopped -- each entry the session gained that no live process maps or holds open fails the
run, named with the test during which it appeared. Cleanup that runs asynchronously (a server's orphan guard) gets
``SETTLE_S`` to finish.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from moe_rl.rollout.shm import held_inodes, shm_entries

SETTLE_S = 15.0

_KEY = pytest.StashKey[dict]()
_LINES = pytest.StashKey[list]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[_KEY] = {"before": set(shm_entries().items()), "seen": {}}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    state = item.session.stash[_KEY]
    before = set(shm_entries().items())
    try:
        return (yield)
    finally:
        for entry in set(shm_entries().items()) - before:
            state["seen"].setdefault(entry, item.nodeid)


def leftovers(before: set[tuple[Path, int]]) -> set[tuple[Path, int]]:
    """Entries in /dev/shm now that were not in ``before`` and that no live process maps or holds open."""
    held = held_inodes()
    return {(path, inode) for path, inode in set(shm_entries().items()) - before if inode not in held}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.stash.get(_KEY, None)
    if state is None or session.testscollected == 0:
        return
    deadline = time.monotonic() + SETTLE_S
    while (left := leftovers(state["before"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not left:
        return
    lines = [f"/dev/shm: the session left {len(left)} entries that no live process maps:"]
    lines += [
        f"  {path.name} (appeared during {state['seen'].get((path, inode), 'the session teardown')})"
        for path, inode in sorted(left)
    ]
    session.config.stash[_LINES] = lines
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    """The leftovers are the run's last lines (after pytest's summary), where a log's tail shows them."""
    lines = config.stash.get(_LINES, None)
    if lines:
        print("\n".join(["=" * 30 + " shm leftovers: the session fails " + "=" * 30, *lines]), file=sys.stderr)
