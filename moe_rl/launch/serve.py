"""A SLURM rollout step's server on the first free port of a range, published in a port file once healthy.

Owns ``python -m moe_rl.launch serve``: run the literal SGLang command the plan rendered, with its ``--port``
set to ``launch.rollout_port``; if the server exits because another process on the node took a port it binds
(its HTTP port or an auxiliary one: ``moe_rl.rollout.ports.lost_a_bind``), start it again on the next port, up to
``--port-tries`` ports, each retry logged; once ``/health`` answers, write the port to ``--port-file``
(atomically), which the job script reads to tell the learners the server's address. Then it waits on the
server, stops the server's process group on SIGTERM/SIGINT/SIGUSR2 (SIGUSR2 is the job script's cleanup;
``launcher.stop_group``, which also removes the ``/dev/shm`` files the group left) and exits with its code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from moe_rl.rollout.launcher import die_with_parent, stop_group
from moe_rl.rollout.ports import lost_a_bind
from moe_rl.rollout.shm import group_shm_files

ROLLOUT_PORT_TRIES = 8  # ports launch.rollout_port .. +7 are tried on each rollout node
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)


class ServerExited(RuntimeError):
    """The server exited before it was healthy; ``lost_port`` says whether a taken port was why."""

    def __init__(self, code: int, lost_port: bool):
        super().__init__(f"exited with code {code} before it was healthy")
        self.code, self.lost_port = code, lost_port


def with_port(argv: list[str], port: int) -> list[str]:
    """``argv`` with the value after its ``--port`` flag replaced by ``port``."""
    if "--port" not in argv:
        raise ValueError(f"the server command has no --port flag: {argv}")
    i = argv.index("--port")
    return [*argv[: i + 1], str(port), *argv[i + 2 :]]


def _copy_output(proc: subprocess.Popen, seen: list[str]) -> None:
    """Echo the server's output to ours (the step's log) and keep it for ``lost_a_bind``."""
    for line in iter(proc.stdout.readline, b""):
        text = line.decode(errors="replace")
        seen.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()


def _start(
    argv: list[str], port: int, timeout_s: float, shm_files: dict[Path, int]
) -> tuple[subprocess.Popen, threading.Thread]:
    """The server on ``port``, healthy; ServerExited or TimeoutError otherwise (its group stopped). ``shm_files``
    gains the ``/dev/shm`` files its group maps, found while it starts and once healthy: a job step's SIGTERM reaches
    the server's processes as it reaches this one, so they may be gone before ``stop_group`` looks."""
    proc = subprocess.Popen(
        with_port(argv, port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent,  # noqa: PLW1509 -- one prctl call in the child, async-signal-safe
    )
    seen: list[str] = []
    echo = threading.Thread(target=_copy_output, args=(proc, seen), daemon=True)
    echo.start()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            shm_files.update(group_shm_files(proc.pid))  # a server that dies before /health leaves them
            if proc.poll() is not None:
                echo.join(timeout=5.0)
                raise ServerExited(proc.returncode, lost_a_bind("".join(seen)))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    shm_files.update(group_shm_files(proc.pid))
                    return proc, echo
            time.sleep(1.0)
        raise TimeoutError(f"not healthy within {timeout_s} s (rollout.startup_timeout_s)")
    except BaseException:
        stop_group(proc, shm_files=shm_files)
        raise


def _publish(port_file: Path, port: int) -> None:
    port_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = port_file.with_name(f".{port_file.name}.{os.getpid()}")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, port_file)


def serve(argv: list[str], first_port: int, tries: int, port_file: Path, timeout_s: float) -> int:
    """Run the server (see the module docstring); returns the exit code for the step.

    SIGTERM, SIGINT and SIGUSR2 stop it, at any point: raised here as SystemExit, they unwind through the blocks that
    stop the server's group and remove its ``/dev/shm`` files. The job script stops its rollout steps with SIGUSR2,
    which ``srun`` forwards as it is (on SIGTERM ``srun`` SIGKILLs its tasks, and a killed wrapper cleans nothing).
    """

    def stop(signum, _frame):
        for s in STOP_SIGNALS:  # the first one stops; another (scancel's TERM, then the script's USR2) must not cut
            signal.signal(s, signal.SIG_IGN)  # the cleanup short
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        return _serve(argv, first_port, tries, port_file, timeout_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _serve(argv: list[str], first_port: int, tries: int, port_file: Path, timeout_s: float) -> int:
    for port in range(first_port, first_port + tries):
        shm_files: dict[Path, int] = {}
        try:
            proc, echo = _start(argv, port, timeout_s, shm_files)
        except ServerExited as exc:
            if not exc.lost_port:
                print(f"moe_rl serve: the server on port {port} {exc}", file=sys.stderr, flush=True)
                return exc.code or 1
            print(
                f"moe_rl serve: port {port} (or one of the server's auxiliary ports) was taken by another "
                f"process; trying port {port + 1} ({port + 1 - first_port + 1}/{tries})",
                file=sys.stderr,
                flush=True,
            )
            continue
        except TimeoutError as exc:
            print(f"moe_rl serve: the server on port {port} was {exc}", file=sys.stderr, flush=True)
            return 1
        _publish(port_file, port)
        print(f"moe_rl serve: healthy on port {port}; published in {port_file}", file=sys.stderr, flush=True)
        try:
            code = proc.wait()
        finally:
            stop_group(proc, shm_files=shm_files)
            if shm_files:  # removed ones are dropped: these belong to a process of the group still alive
                print(f"moe_rl serve: {len(shm_files)} /dev/shm files of the server left", file=sys.stderr, flush=True)
        echo.join(timeout=5.0)
        return code
    print(f"moe_rl serve: ports {first_port}-{first_port + tries - 1} were all taken", file=sys.stderr, flush=True)
    return 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--first-port", type=int, required=True, help="launch.rollout_port")
    parser.add_argument("--port-tries", type=int, default=ROLLOUT_PORT_TRIES)
    parser.add_argument("--port-file", type=Path, required=True, help="written with the port once healthy")
    parser.add_argument("--startup-timeout", type=float, required=True, help="rollout.startup_timeout_s, per try")
    parser.add_argument("server", nargs=argparse.REMAINDER, help="-- the server command (its --port is replaced)")
