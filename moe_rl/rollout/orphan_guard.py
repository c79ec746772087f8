"""A launched SGLang server takes itself down once the process that launched it is gone.

Owns ``watch_parent(parent_pid)``, started by ``sglang_entry`` in the server's main process (the launcher
passes its own pid as ``MOE_RL_PARENT_PID``): a daemon thread checks every ``POLL_S`` whether the server
has been re-parented -- its launcher died, even by SIGKILL -- and then stops the server's process group
(SIGTERM, SIGKILL after ``GRACE_S``) and exits. It removes the ``/dev/shm`` files the group holds
(SGLang's ``sglang_loads_*.shm``) before it signals anyone: the processes keep their mappings, and
SGLang may kill this process as soon as a child exits. The kernel's parent-death signal
(``PR_SET_PDEATHSIG``) follows the launching *thread*, so the launcher uses it only for servers started on
its main thread; the guard covers every server whichever thread started it (a server restarted by the async
producer) and runs the ``/dev/shm`` cleanup that a killed trainer never gets to.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

from moe_rl.rollout.shm import group_shm_files, remove_shm_files

__all__ = ["ENV", "GRACE_S", "POLL_S", "group_pids", "watch_parent"]

ENV = "MOE_RL_PARENT_PID"
POLL_S = 0.5
GRACE_S = 3.0


def watch_parent(parent_pid: int) -> threading.Thread:
    """Start the guard thread of this server process (the leader of its own process group)."""
    thread = threading.Thread(target=_watch, args=(int(parent_pid),), name="moe_rl-orphan-guard", daemon=True)
    thread.start()
    return thread


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    _stop_group_and_exit()


def group_pids(pgid: int) -> list[int]:
    """Live processes of group ``pgid``; zombies (dead, waiting to be reaped) do not count."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == pgid and state not in "ZX":
                pids.append(int(stat.parent.name))
    return pids


def _stop_group_and_exit() -> None:
    me, pgid = os.getpid(), os.getpgrp()
    # Unlink first: the processes keep their mappings, and SGLang's own subprocess watchdog answers a
    # child's non-zero exit with SIGQUIT to this process, whose handler kills the whole tree -- this
    # thread included -- possibly before the group is gone (a CI run lost the race once).
    files = group_shm_files(pgid)
    remove_shm_files(files)

    def others() -> list[int]:
        return [p for p in group_pids(pgid) if p != me]

    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 2.0)):
        for pid in others():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while others() and time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(0)
