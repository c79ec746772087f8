"""The /dev/shm leak's two halves, without a server: a named semaphore is found by inode in a process group
(glibc maps it under a deleted temp name) and removed after the group is killed; and a process that imports
``sglang_entry`` (as every spawned SGLang process does) gives tqdm no named semaphore at all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from moe_rl.rollout.shm import group_shm_files, remove_shm_files
from tests.conftest import repo_env

ROOT = Path(__file__).parents[2]
HOLD_A_SEMAPHORE = """
import multiprocessing as mp, sys, time
lock = mp.get_context("spawn").Lock()  # spawn: a named /dev/shm/sem.mp-* that only a finalizer unlinks
print("/dev/shm/sem." + lock._semlock.name.lstrip("/"), flush=True)
time.sleep(120)
"""
TQDM_LOCKS = """
import multiprocessing as mp, sys
mp.set_start_method("spawn")
if sys.argv[1] == "entry":
    import moe_rl.rollout.sglang_entry  # noqa: F401 - what SGLang's spawned scheduler imports as __mp_main__
from tqdm import tqdm
list(tqdm(range(2), disable=True))
print([type(lk).__name__ for lk in tqdm.get_lock().locks])
"""


def test_a_killed_groups_semaphore_is_found_by_inode_and_removed():
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_SEMAPHORE], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        sem = Path(holder.stdout.readline().strip())
        assert sem.name.startswith("sem.mp-") and sem.exists()
        maps = Path(f"/proc/{holder.pid}/maps").read_text()
        assert str(sem) not in maps  # mapped under glibc's deleted temp name: a name search misses it
        found = group_shm_files(holder.pid)
        assert found.get(sem) == sem.stat().st_ino
        os.killpg(holder.pid, signal.SIGKILL)  # no finalizer runs: the semaphore stays behind
        holder.wait(timeout=30)
        time.sleep(0.2)
        assert sem.exists()
        remove_shm_files(found)
        assert not sem.exists()
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)


def test_importing_sglang_entry_leaves_tqdm_without_a_multiprocessing_lock():
    env = repo_env(ROOT)
    run = lambda how: subprocess.run(
        [sys.executable, "-c", TQDM_LOCKS, how],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert "RLock" in run("plain")  # tqdm's default: a multiprocessing RLock (a named semaphore under spawn)
    assert run("entry") == "['RLock']" and "multiprocessing" not in run("entry")
