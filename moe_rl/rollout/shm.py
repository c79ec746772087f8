"""The ``/dev/shm`` entries of a server's process group: found while it runs, removed once it is gone.

SGLang leaves shared-memory files behind when its processes are stopped or crash (its
``sglang_loads_*.shm`` load snapshots; POSIX semaphores ``sem.mp-*`` of multiprocessing objects made
under the spawn start method, whose finalizers never run in a killed process). The launcher records
what the group maps or holds open (``group_shm_files``) at start-up, while it waits for ``/health``
and when it stops the group, and removes those files once no process of the group is left. A file the group made
after the last look (a scheduler still starting when the stop came) is found by ``orphans_since``: an SGLang load
snapshot (``ORPHAN_PREFIXES``) made since the group's leader started that no live process maps or holds open.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
ORPHAN_PREFIXES = ("sglang_loads_",)  # SGLang's load snapshots: made by the scheduler, mapped as long as it lives


def group_shm_files(pgid: int, shm_dir: Path = SHM_DIR) -> dict[Path, int]:
    """``{path: inode}`` of the ``/dev/shm`` entries mapped or open in any process of group ``pgid``.

    Matched by inode, not by the name a process shows: glibc creates a POSIX semaphore (``sem.mp-*``, e.g.
    tqdm's multiprocessing lock in SGLang's spawned scheduler) as a temp file, maps it and then links it
    under its name, so ``/proc/<pid>/maps`` shows ``/dev/shm/sem.XXXXXX (deleted)`` for a live ``sem.mp-*``.
    """
    inodes = held_inodes(pgid, shm_dir)
    return {path: inode for path, inode in shm_entries(shm_dir).items() if inode in inodes}


def shm_entries(shm_dir: Path = SHM_DIR) -> dict[Path, int]:
    """``{path: inode}`` of every entry in ``shm_dir`` now."""
    found: dict[Path, int] = {}
    with contextlib.suppress(OSError), os.scandir(shm_dir) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                found[Path(entry.path)] = entry.inode()
    return found


def held_inodes(pgid: int | None = None, shm_dir: Path = SHM_DIR) -> set[int]:
    """Inodes of the ``shm_dir`` files mapped or open in a live process of group ``pgid`` (None: any process)."""
    inodes: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if pgid is not None and os.getpgid(int(proc.name)) != pgid:
                continue
            inodes.update(
                int(fields[4])
                for line in (proc / "maps").read_text().splitlines()
                if len(fields := line.split(maxsplit=5)) == 6 and fields[5].startswith(f"{shm_dir}/")
            )
        except (OSError, ProcessLookupError, ValueError):
            continue
        for fd in (proc / "fd").glob("*"):
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith(f"{shm_dir}/"):
                    inodes.add(os.stat(fd).st_ino)
    return inodes


def remove_shm_files(files: dict[Path, int]) -> None:
    """Unlink each path that still is the same file (same inode): a reused name is somebody else's."""
    for path, inode in files.items():
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:
                path.unlink()


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, to the clock tick); None once it is gone."""
    try:
        start_ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines() if ln.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


def orphans_since(since: float, shm_dir: Path = SHM_DIR) -> dict[Path, int]:
    """``{path: inode}`` of the ``ORPHAN_PREFIXES`` entries made at or after ``since`` (1 s of slack: ``btime`` is
    whole seconds) that no live process maps or holds open."""
    held = held_inodes(None, shm_dir)
    found: dict[Path, int] = {}
    for path, inode in shm_entries(shm_dir).items():
        if path.name.startswith(ORPHAN_PREFIXES) and inode not in held:
            with contextlib.suppress(OSError):
                if path.stat().st_ctime >= since - 1.0:
                    found[path] = inode
    return found
