"""Start, health-check and always stop local SGLang rollout servers; or use given addresses.

Owns the server process lifecycle: spawning the command and environment ``server_spec`` builds (in its own
process group, pinned to ``rollout.server_cpus``), the log file, waiting for ``/health``, starting again on a
port lost to another process (``ports``), teardown of the whole process group (SIGTERM, then SIGKILL) on exit,
on exceptions, and removal of the shared-memory files the group left in ``/dev/shm``. A run's set of servers,
their restarts and their teardown on SIGTERM are ``server_pool``'s. It does not talk the generation protocol
(client.py) or sync weights (``moe_rl.sync``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from moe_rl.rollout.auth import ServerKeys
from moe_rl.rollout.orphan_guard import ENV as ORPHAN_ENV
from moe_rl.rollout.orphan_guard import group_pids
from moe_rl.rollout.ports import free_port, lost_a_bind
from moe_rl.rollout.server_spec import ServerSpec, server_command, server_env
from moe_rl.rollout.shm import group_shm_files, orphans_since, process_start_time, remove_shm_files

logger = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message carries its log tail."""


class PortTakenError(ServerStartError):
    """The server exited because a port it binds (its HTTP port or an auxiliary one) was taken meanwhile."""


# A server start that loses its port (or an auxiliary one) to another process is tried this often in all.
BIND_TRIES = 3


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the server if the launching process dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _pin(pid: int, cpus: Sequence[int]) -> None:
    try:
        os.sched_setaffinity(pid, set(cpus))
    except OSError as exc:
        raise ServerStartError(
            f"rollout.server_cpus={list(cpus)}: cannot pin the server to these cores ({exc}); "
            f"this machine allows {sorted(os.sched_getaffinity(0))}"
        ) from None


def _read_from(path: Path, offset: int) -> str:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")
    return ""


def log_tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "<no log>"


@dataclass
class SGLangServer:
    """One local SGLang server process (context manager). `url` is valid after `start()`."""

    spec: ServerSpec
    log_path: Path
    url: str = ""
    process: subprocess.Popen | None = field(default=None, repr=False)
    shm_files: dict[Path, int] = field(
        default_factory=dict, repr=False
    )  # path -> inode; removed when the group is gone
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)  # a generated key (auth.RUN_ADMIN_KEY_ENV)
    _log_start: int = field(default=0, repr=False)  # where this start's lines begin in the (appended) log

    def start(self) -> SGLangServer:
        """Spawn the server in its own process group and wait for `/health` (ServerStartError).

        A start that loses a port to another process before SGLang binds it (``PortTakenError``: a busy host) is
        tried again, ``BIND_TRIES`` starts in all, each retry logged: on a fresh port when the port is ours to
        choose and nobody holds the address yet (a first start without ``rollout.port``), else on the same port
        (SGLang draws its auxiliary ports anew). A restarted server keeps its port, so the addresses the client
        holds stay valid.
        """
        if self.spec.startup_timeout_s is None:  # a spec from a rollout section whose value is derived
            raise ValueError(
                "rollout.startup_timeout_s is unset (derived from the whole config): pass "
                "startup_timeout_s=moe_rl.sizing.startup_timeout(cfg).value to the server spec"
            )
        environ = {**os.environ, **self.secret_env}
        keys = ServerKeys.from_env_names(self.spec.api_key_env, self.spec.admin_api_key_env, environ)  # unset: fail now
        if (
            self.spec.device == "cpu"
            and self.spec.deterministic
            and self.spec.dtype == "float32"
            and not self.spec.true_on_policy
        ):
            logger.warning(
                "deterministic rollouts on CPU are bit-exact across batch compositions only in bfloat16: "
                "fp32 CPU matmuls change kernels with the batch size (docs/sglang.md)"
            )
        ours = not self.url and not self.spec.port
        port = int(self.url.rsplit(":", 1)[1]) if self.url else self.spec.port or free_port(self.spec.host)
        for attempt in range(1, BIND_TRIES + 1):
            self.url = f"http://{self.spec.host}:{port}"
            try:
                return self._start_once(port, keys)
            except PortTakenError as err:
                if attempt == BIND_TRIES:
                    raise
                lost, port = port, free_port(self.spec.host) if ours else port
                logger.warning(
                    "SGLang server on port %d lost a port to another process before binding it (%s); "
                    "start %d/%d on port %d",
                    lost,
                    err.args[0].splitlines()[0],
                    attempt + 1,
                    BIND_TRIES,
                    port,
                )
        raise AssertionError("unreachable")

    def _start_once(self, port: int, keys: ServerKeys) -> SGLangServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self.process = subprocess.Popen(
                server_command(self.spec, port),
                env={**server_env(self.spec), **self.secret_env, ORPHAN_ENV: str(os.getpid())},  # orphan_guard
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: stop() kills the scheduler children too
                preexec_fn=die_with_parent if threading.current_thread() is threading.main_thread() else None,  # noqa: PLW1509 -- one prctl call in the child, async-signal-safe
            )
        try:
            if self.spec.cpu_affinity:  # before the interpreter starts its threads and the scheduler process
                _pin(self.process.pid, self.spec.cpu_affinity)
            self.wait_healthy(self.spec.startup_timeout_s)
            self.freeze_gc(keys)
        except BaseException:
            self.stop()
            raise
        self.shm_files.update(group_shm_files(self.process.pid))
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        deadline, looked = time.monotonic() + timeout_s, 0.0
        while time.monotonic() < deadline:
            if self.process is not None and time.monotonic() - looked > 2.0:  # a crash before /health answers
                self.shm_files.update(group_shm_files(self.process.pid))  # must not leave its files behind
                looked = time.monotonic()
            if self.process is not None and self.process.poll() is not None:
                this_start = _read_from(self.log_path, self._log_start)
                error = PortTakenError if lost_a_bind(this_start) else ServerStartError
                raise error(
                    f"SGLang server exited with code {self.process.returncode} before it was healthy; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise ServerStartError(
            f"SGLang server at {self.url} was not healthy within startup_timeout_s={timeout_s}; "
            f"log {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def freeze_gc(self, keys: ServerKeys) -> None:
        """SGLang's ``/freeze_gc`` once the server answers (its processes' start-up objects leave the collector's
        generations). SGLang posts it itself right after start-up, but with ``--skip-server-warmup`` that post races the
        HTTP server coming up and is lost about one start in three ("post-warmup freeze_gc failed" in the log); then
        every ``/flush_cache``, one per weight push, runs a full collection over the scheduler's heap on CPU: 0.34 s
        instead of 0.014 s on the demo's model (bench/bench_async.py, docs/benchmarks.md). Freezing twice is harmless.
        A failure only costs that time: a warning naming the server, not a failed start."""
        try:
            resp = httpx.post(f"{self.url}/freeze_gc", headers=keys.headers(admin=True), timeout=30.0)
            problem = None if resp.status_code == 200 else f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as err:
            problem = f"{type(err).__name__}: {err}"
        if problem is not None:
            logger.warning(
                "SGLang server at %s: /freeze_gc failed (%s); each weight push's cache flush may then "
                "collect the whole heap (~0.3 s on CPU)",
                self.url,
                problem,
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace_s`; idempotent."""
        proc, self.process = self.process, None
        if proc is not None:
            stop_group(proc, grace_s, self.shm_files)

    def restart(self) -> None:
        """Stop what is left of the server and start it again on the same port."""
        self.stop(grace_s=5.0)
        self.start()

    def __enter__(self) -> Self:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_group(proc: subprocess.Popen, grace_s: float = 15.0, shm_files: dict[Path, int] | None = None) -> None:
    """SIGTERM the process group ``proc`` leads (started with ``start_new_session=True``), SIGKILL what is left after
    ``grace_s``; once the group is gone, remove the ``/dev/shm`` files it mapped (``shm_files``, path -> inode, is
    updated with those it maps now and cleared when removed): nobody maps them any more, and SGLang leaves them."""
    pgid = proc.pid  # the group id is the leader's pid
    files = {} if shm_files is None else shm_files
    files.update(group_shm_files(pgid))
    started = process_start_time(pgid)  # files the group makes from here on are found by orphans_since
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
        if not _group_alive(pgid):
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1.0)
    if not _group_alive(pgid):
        if started is not None:  # a scheduler that made its load snapshot after the last look
            files.update(orphans_since(started))
        remove_shm_files(files)
        files.clear()


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs; zombies (dead, waiting for init to reap them) do not count."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_pids(pgid))
