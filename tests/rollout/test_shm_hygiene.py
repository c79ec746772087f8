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

from moe_rl.rollout.launcher import stop_group
from moe_rl.rollout.shm import group_shm_files, process_start_time, remove_shm_files
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


MAKE_A_SNAPSHOT_THEN_DIE = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # still shutting down when the stop's SIGTERM comes
path = sys.argv[1]
print("ready", flush=True)
if sys.argv[2] == "hold":
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)  # held open as long as this process lives
    print("held", flush=True)
    time.sleep(120)
time.sleep(0.3)  # made after the stop began: no earlier look at the group saw it
open(path, "wb").write(b"x")
os._exit(0)  # dies without unlinking it, as a killed scheduler does
"""


def test_a_load_snapshot_made_after_the_last_look_is_removed_once_the_group_is_gone(tmp_path):
    """Issue 57 (6), the race a clean-clone CI hit once (SIGTERM during a server's start): the group's scheduler made
    its ``sglang_loads_*.shm`` after ``stop_group`` last looked, and died. ``stop_group`` now also removes the load
    snapshots made since the group's leader started that no live process holds; one still held by a live process
    stays. Break tried: without the ``orphans_since`` sweep the late file stays."""
    held = Path(f"/dev/shm/sglang_loads_moe_rl_test_held_{os.getpid()}.shm")
    late = Path(f"/dev/shm/sglang_loads_moe_rl_test_late_{os.getpid()}.shm")
    holder = subprocess.Popen(
        [sys.executable, "-c", MAKE_A_SNAPSHOT_THEN_DIE, str(held), "hold"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert holder.stdout.readline().strip() == "held"
        group = subprocess.Popen(
            [sys.executable, "-c", MAKE_A_SNAPSHOT_THEN_DIE, str(late), "late"],
            start_new_session=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert group.stdout.readline().strip() == "ready"  # its SIGTERM handler is in place
        stop_group(group, grace_s=5.0)
        assert group.returncode == 0, "the group did not live to make its file"
        assert not late.exists(), "the load snapshot made after the last look outlived its group"
        assert held.exists(), "a snapshot a live process holds was removed"
    finally:
        holder.kill()
        holder.wait()
        for path in (held, late):
            path.unlink(missing_ok=True)


def test_process_start_time_is_now_for_a_new_process_and_none_once_it_is_gone():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = process_start_time(proc.pid)
        assert started is not None and abs(started - time.time()) < 5.0
    finally:
        proc.kill()
        proc.wait()
    assert process_start_time(proc.pid) is None
