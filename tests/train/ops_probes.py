"""Probes for end-to-end operations tests: start a command as a terminal would, find a run's server, and
list the ``/dev/shm`` entries left behind (new since a snapshot, and held by no live process)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

SHM = Path("/dev/shm")


def _as_in_a_terminal() -> None:
    """preexec_fn: the child starts with SIGINT at its default, as a foreground job in a terminal does.

    A parent that ignores SIGINT (a non-interactive shell's background job ``make test &``, ``nohup``-style
    harnesses) passes SIG_IGN on through fork and exec, and Python then installs no KeyboardInterrupt
    handler: a "Ctrl-C" sent to the child would be silently ignored and the run would finish with 0.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_like_a_terminal(cmd: list[str], env: dict, **kwargs) -> subprocess.Popen:
    """``cmd`` in its own session (its own foreground group, as in a terminal) with SIGINT at its default."""
    return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_as_in_a_terminal, **kwargs)  # noqa: PLW1509 -- one signal() call


def server_of(run_dir: Path, trainer: subprocess.Popen, timeout_s: float = 300) -> tuple[int, str]:
    """``(pid, url)`` of the healthy SGLang server the trainer in ``run_dir`` launched (its group leader)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and trainer.poll() is None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                if "moe_rl.rollout.sglang_entry" not in argv or not any(str(run_dir) in a for a in argv):
                    continue
                pid = int(entry.name)
                if os.getpgid(pid) != pid:
                    continue
            except (OSError, ProcessLookupError):
                continue
            url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return pid, url
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    tail = trainer.stderr.read()[-3000:] if trainer.poll() is not None and trainer.stderr else ""
    raise AssertionError(f"no healthy server of {run_dir} (trainer exit code {trainer.poll()}):\n{tail}")


def shm_snapshot() -> set[str]:
    return {p.name for p in SHM.iterdir()}


def _live_shm_inodes() -> set[int]:
    """Inodes of /dev/shm files any live process maps or holds open (a semaphore is mapped under a deleted
    temp name, so names would miss it)."""
    return _held_inodes(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())


def _held_inodes(pids) -> set[int]:
    inodes: set[int] = set()
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        try:
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
                    inodes.add(int(fields[4]))
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd).startswith(f"{SHM}/"):
                    inodes.add(os.stat(fd).st_ino)
        except (OSError, ValueError):
            continue
    return inodes


def _descendants(root: int) -> set[int]:
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in found}
        found |= frontier
    return found


class ShmWatch(threading.Thread):
    """Polls which /dev/shm inodes ``root`` and its descendants (the trainer, its servers' processes) hold,
    so that what is left over afterwards can be told apart from other runs' files on a shared machine."""

    def __init__(self, root: int, period_s: float = 0.3):
        super().__init__(daemon=True)
        self.root, self.period_s, self.inodes, self.done = root, period_s, set(), threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.inodes |= _held_inodes(_descendants(self.root))
            self.done.wait(self.period_s)

    def stop(self) -> set[int]:
        self.done.set()
        self.join()
        return self.inodes


def shm_left_over(before: set[str], ours: set[int] | None = None, settle_s: float = 10.0) -> list[str]:
    """Entries new since ``before`` (among inodes ``ours`` when given) that no live process holds; waits up to
    ``settle_s`` for them to go."""
    deadline = time.monotonic() + settle_s
    while True:
        live = _live_shm_inodes()
        left = []
        for name in shm_snapshot() - before:
            try:
                inode = (SHM / name).stat().st_ino
            except FileNotFoundError:
                continue
            if inode not in live and (ours is None or inode in ours):
                left.append(name)
        if not left or time.monotonic() > deadline:
            return sorted(left)
        time.sleep(1.0)
