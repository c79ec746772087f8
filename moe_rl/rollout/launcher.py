"""Start, health-check and always stop local SGLang rollout servers; or use given addresses.

Owns the server process lifecycle: the command line (CPU or GPU flags, routed experts always on,
deterministic inference when asked, the sampling-mask cap, API keys by variable name through
``sglang_entry``), the server's environment (CPU stand-ins on its path only), the log file, waiting
for ``/health``, teardown of the whole process group (SIGTERM, then SIGKILL) on exit, on exceptions and
and removal of the shared-memory files the group left in ``/dev/shm``. A run's set of servers, their
restarts and their teardown on SIGTERM are ``server_pool``'s. It does not talk the generation protocol
(client.py) or sync weights (``moe_rl.sync``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from moe_rl.exact.contract import SERVER_ENV as KERNELS_ENV
from moe_rl.exact.contract import kernels_of, server_env_value
from moe_rl.rollout.auth import ServerKeys
from moe_rl.rollout.orphan_guard import ENV as ORPHAN_ENV
from moe_rl.rollout.orphan_guard import group_pids
from moe_rl.rollout.shm import group_shm_files, remove_shm_files

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
STUBS_DIR = REPO_ROOT / "patches" / "stubs"


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message carries its log tail."""


class PortTakenError(ServerStartError):
    """The server exited because a port it binds (its HTTP port or an auxiliary one) was taken meanwhile."""


@dataclass(frozen=True)
class ServerSpec:
    """How to launch one SGLang server for `model_path` (mirrors the `rollout` config section)."""

    model_path: str
    device: str = "cpu"  # "cpu" | "cuda"
    host: str = "127.0.0.1"
    port: int | None = None  # None = a free port
    dtype: str = "float32"
    deterministic: bool = True
    true_on_policy: bool = False  # MOE_RL_TRUE_ON_POLICY=1: patch 0013 routes the forward through moe_rl.exact
    true_on_policy_kernels: str | None = None  # a subset of the contract's items (diagnose --attribute); None = all
    seed: int = 0
    sampling_mask_max_tokens: int = 4096
    mem_fraction_static: float = 0.05
    max_total_tokens: int = 4096
    startup_timeout_s: float = 180.0
    sleep_on_idle: bool = True  # --sleep-on-idle: no busy-wait between rollouts (the learner shares the cores)
    cpu_threads: int | None = None  # CPU engine: torch intra-op threads (None = all cores)
    cpu_affinity: tuple[int, ...] = ()  # rollout.server_cpus: cores the server's processes run on (() = any)
    extra_args: tuple[str, ...] = ()
    api_key_env: str | None = None  # names of the variables holding the keys (never the keys)
    admin_api_key_env: str | None = None

    @classmethod
    def from_rollout_config(cls, rollout, model_path: str | Path, **overrides) -> ServerSpec:
        """Spec from a `moe_rl.config` RolloutConfig; keyword overrides win."""
        values = dict(
            model_path=str(model_path),
            device=rollout.device,
            host=rollout.host,
            port=rollout.port,
            dtype=rollout.dtype,
            deterministic=rollout.deterministic,
            true_on_policy=rollout.true_on_policy,
            true_on_policy_kernels=server_env_value(kernels_of(rollout)) if rollout.true_on_policy else None,
            seed=rollout.seed,
            sampling_mask_max_tokens=rollout.sampling_mask_max_tokens,
            mem_fraction_static=rollout.mem_fraction_static,
            max_total_tokens=rollout.max_total_tokens,
            startup_timeout_s=rollout.startup_timeout_s,
            sleep_on_idle=rollout.sleep_on_idle,
            cpu_affinity=tuple(rollout.server_cpus),
            extra_args=tuple(rollout.extra_server_args),
            api_key_env=rollout.api_key_env,
            admin_api_key_env=rollout.admin_api_key_env,
        )
        values.update(overrides)
        return cls(**values)


# Ports handed out by the kernel for outgoing connections and bind(0) start here (Linux default); a port chosen in
# that range can be taken by any process's next connection before SGLang binds it.
_EPHEMERAL_LOW_DEFAULT = 32768
# Our range sits below SGLang's own choice for its auxiliary (nccl/gloo store) port, 22000-29999.
_PORT_RANGE = (10000, 21999)
# A server start that loses its port (or an auxiliary one) to another process is tried this often in all.
BIND_TRIES = 3
# How a lost bind reads in the server log: uvicorn's ``[Errno 98] ... address already in use`` (HTTP port, exit
# code 3), torch's TCPStore ``EADDRINUSE`` (the scheduler's auxiliary port), ZMQ's ``Address already in use``.
_BIND_FAILURE_MARKS = ("errno 98", "eaddrinuse", "address already in use")


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A TCP port on `host` that was free a moment ago, chosen at random below the kernel's ephemeral range.

    Not ``bind(("", 0))``: that hands out ephemeral ports, the same pool every outgoing connection on the
    machine draws from, so the port is often taken again before the server binds it (a busy host's port race).
    Falls back to ``bind(0)`` if 64 random tries in the range all fail."""
    rng = rng or random.Random()
    low, high = _PORT_RANGE
    high = min(high, _ephemeral_low() - 1)
    for port in rng.sample(range(low, high + 1), min(64, max(0, high - low + 1))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return _EPHEMERAL_LOW_DEFAULT


def lost_a_bind(log_text: str) -> bool:
    """Whether a server log says a port it wanted to bind was taken (by another process)."""
    low = log_text.lower()
    return any(mark in low for mark in _BIND_FAILURE_MARKS)


def server_command(spec: ServerSpec, port: int, python: str = sys.executable) -> list[str]:
    """The server argv for `spec` on `port`: SGLang's launch_server through `sglang_entry` (keys by variable)."""
    keys = [
        *(("--api-key-env", spec.api_key_env) if spec.api_key_env else ()),
        *(("--admin-api-key-env", spec.admin_api_key_env) if spec.admin_api_key_env else ()),
    ]
    cmd = [
        python,
        "-m",
        "moe_rl.rollout.sglang_entry",
        *keys,
        "--model-path",
        spec.model_path,
        "--device",
        spec.device,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--dtype",
        spec.dtype,
        "--random-seed",
        str(spec.seed),
        "--mem-fraction-static",
        str(spec.mem_fraction_static),
        "--max-total-tokens",
        str(spec.max_total_tokens),
        "--sampling-mask-max-tokens",
        str(spec.sampling_mask_max_tokens),
        # Routing replay (R2/R3) needs the router's top-k of every forwarded token.
        "--enable-return-routed-experts",
        "--skip-server-warmup",
    ]
    if spec.deterministic:
        # Batch-invariant numerics + per-request `sampling_seed`; without the flag the seed is ignored.
        cmd.append("--enable-deterministic-inference")
    if spec.sleep_on_idle:
        cmd.append("--sleep-on-idle")
    return cmd + list(spec.extra_args)


# The learner's launcher (torchrun / torch.distributed) describes *its* process group in these; a
# server started from rank 0 that inherits them joins that rendezvous and never becomes healthy.
_LEARNER_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def server_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: the learner's distributed variables removed; on CPU, the CPU engine
    switch and the stand-ins on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    for key in [k for k in env if k in _LEARNER_DIST_VARS or k.startswith("TORCHELASTIC_")]:
        del env[key]
    if spec.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # otherwise is_cpu() is false and CUDA paths are taken
        # Our SIGTERM of the group reaches the scheduler first; SGLang's parent takes that for a crash and sleeps
        # 5 s "to let GPU activity settle" before py-spy / CUDA core dumps: on CPU every stop paid it, for nothing
        for var in ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"):
            env.setdefault(var, "0")
        env.setdefault("MOE_RL_SGLANG_START_METHOD", "fork")  # children inherit the imports (sglang_entry)
        env.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", "moe_rl.rollout.sglang_models")  # others load on demand
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUBS_DIR), env.get("PYTHONPATH", "")) if p)
        if spec.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(spec.cpu_threads)
    env.pop("MOE_RL_TRUE_ON_POLICY", None)
    env.pop(KERNELS_ENV, None)
    if spec.true_on_policy:
        env["MOE_RL_TRUE_ON_POLICY"] = "1"  # read by moe_rl.exact.sglang_hooks (patch 0013)
        if spec.true_on_policy_kernels is not None:
            env[KERNELS_ENV] = spec.true_on_policy_kernels
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


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
                preexec_fn=die_with_parent if threading.current_thread() is threading.main_thread() else None,
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
        if proc is None:
            return
        pgid = proc.pid  # start_new_session=True: the group id is the leader's pid
        self.shm_files.update(group_shm_files(pgid))
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)
            if not _group_alive(pgid):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
        if not _group_alive(pgid):  # nobody maps them any more: SGLang leaves these behind
            remove_shm_files(self.shm_files)
            self.shm_files.clear()

    def restart(self) -> None:
        """Stop what is left of the server and start it again on the same port."""
        self.stop(grace_s=5.0)
        self.start()

    def __enter__(self) -> SGLangServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs; zombies (dead, waiting for init to reap them) do not count."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_pids(pgid))
