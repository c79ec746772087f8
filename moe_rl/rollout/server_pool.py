"""A run's rollout servers: the ones it launches (restartable, all stopped at the end) or the addresses it is given.

Owns ``ServerPool`` -- the run's one supervisor of server life: bounded restarts of a dead server
(``rollout.max_server_restarts``) under one lock, whichever thread or process noticed the failure, none once
the pool is closing, and the record of every restart (``restart_since``: a caller learns of the restarts others
made) -- and ``rollout_server_pool`` / ``rollout_servers``, which start the servers one after another and stop
them when the block exits for any reason, SIGTERM and SIGHUP included (``terminate_on_signals``). One server's
process life is ``launcher.SGLangServer``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from moe_rl.console import raise_terminated
from moe_rl.rollout.auth import RUN_ADMIN_KEY_ENV, ServerKeys
from moe_rl.rollout.launcher import ServerStartError, SGLangServer, log_tail
from moe_rl.rollout.server_spec import ServerSpec

__all__ = ["ServerPool", "check_addresses", "rollout_server_pool", "rollout_servers", "terminate_on_signals"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def terminate_on_signals() -> Iterator[None]:
    """In the main thread, raise SIGTERM/SIGHUP as ``console.Terminated`` so `finally` blocks stop servers (and
    ``moe-rl`` says so in one line)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@dataclass
class ServerPool:
    """The rollout servers of a run: local ones (restartable) or external `addresses` (not ours to restart)."""

    servers: list[SGLangServer] = field(default_factory=list)
    external: list[str] = field(default_factory=list)
    max_restarts: int = 0
    restarted: list[str] = field(default_factory=list)  # the URL of every restart, in order
    keys: ServerKeys = field(default_factory=lambda: ServerKeys(), repr=False)  # what every call must carry
    closing: bool = False  # set by close(): no server is (re)started after it
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # restart() vs close(), any thread

    @property
    def restarts(self) -> int:
        """Restarts used so far (of ``max_restarts``)."""
        return len(self.restarted)

    @property
    def addresses(self) -> list[str]:
        return [s.url for s in self.servers] if self.servers else list(self.external)

    def close(self) -> None:
        """Stop every local server; a restart under way (another thread) finishes first, none starts after."""
        with self._lock:
            self.closing = True
        for s in self.servers:
            s.stop()

    def restart(self, urls: Sequence[str] | None = None) -> list[str]:
        """Restart the local servers in `urls` (default: those whose process exited); returns their URLs.

        [] when none qualifies (e.g. external servers) or the pool is closing. ServerStartError once
        `max_restarts` are used up.
        """
        with self._lock:
            if self.closing:
                return []
            return self._restart(urls)

    def restart_since(self, seen: int, urls: Sequence[str] | None = None) -> tuple[list[str], int]:
        """``restart(urls)`` for a caller that knew of ``seen`` restarts: also the servers restarted since by anyone
        (its failed request may have hit one of them; a named one is not restarted again); ``(URLs, restarts)``."""
        with self._lock:
            since = self.restarted[seen:]
            fresh = [] if self.closing else self._restart(None if urls is None else [u for u in urls if u not in since])
            return list(dict.fromkeys([*since, *fresh])), self.restarts

    def _restart(self, urls: Sequence[str] | None) -> list[str]:
        chosen = [s for s in self.servers if (s.url in urls if urls is not None else not s.alive())]
        for s in chosen:
            code = s.process.poll() if s.process is not None else None
            if self.restarts >= self.max_restarts:
                raise ServerStartError(
                    f"rollout server {s.url} failed (exit code {code}) and all rollout.max_server_restarts="
                    f"{self.max_restarts} restarts are used; log {s.log_path}:\n{log_tail(s.log_path)}"
                )
            self.restarted.append(s.url)
            logger.warning(
                "rollout server %s failed (exit code %s); restart %d/%d, log %s",
                s.url,
                code,
                self.restarts,
                self.max_restarts,
                s.log_path,
            )
            s.restart()
        return [s.url for s in chosen]


@contextlib.contextmanager
def rollout_server_pool(
    rollout,
    model_path: str | Path,
    log_dir: str | Path,
    num_servers: int = 1,
    keys: ServerKeys | None = None,
    **spec_overrides,
) -> Iterator[ServerPool]:
    """Yield a ServerPool: `rollout.addresses` as given, else `num_servers` local servers.

    Local servers are started one after another (a 2-core machine cannot overlap their imports),
    and all of them are stopped when the block exits for any reason, including SIGTERM. ``keys``
    (default ``ServerKeys.for_run(rollout)``): with a generated key the servers get it through their
    environment only; ``pool.keys`` is what every call to them must carry.
    """
    keys = ServerKeys.for_run(rollout) if keys is None else keys
    if rollout.addresses:
        yield ServerPool(external=[a.rstrip("/") for a in rollout.addresses], keys=keys)
        return
    if num_servers < 1:
        raise ValueError(f"num_servers={num_servers}; expected >= 1")
    pool = ServerPool(max_restarts=getattr(rollout, "max_server_restarts", 0), keys=keys)
    if keys.generated:
        spec_overrides = {**spec_overrides, "admin_api_key_env": RUN_ADMIN_KEY_ENV}
    with terminate_on_signals():
        try:
            for i in range(num_servers):
                spec = ServerSpec.from_rollout_config(rollout, model_path, **spec_overrides)
                if spec.port is not None and num_servers > 1:
                    spec = dataclasses.replace(spec, port=spec.port + i)
                pool.servers.append(SGLangServer(spec, Path(log_dir) / f"sglang_{i}.log", secret_env=keys.server_env()))
                pool.servers[-1].start()
            yield pool
        finally:
            pool.close()


@contextlib.contextmanager
def rollout_servers(
    rollout, model_path: str | Path, log_dir: str | Path, num_servers: int = 1, **spec_overrides
) -> Iterator[list[str]]:
    """Yield server base URLs (see `rollout_server_pool`, which also offers restarts)."""
    with rollout_server_pool(rollout, model_path, log_dir, num_servers, **spec_overrides) as pool:
        yield pool.addresses


def check_addresses(addresses: Sequence[str], timeout_s: float = 5.0) -> None:
    """Raise ConnectionError naming every address whose `/health` is not 200."""
    bad = []
    for a in addresses:
        try:
            if httpx.get(f"{a}/health", timeout=timeout_s).status_code != 200:
                bad.append(a)
        except httpx.HTTPError:
            bad.append(a)
    if bad:
        raise ConnectionError(f"SGLang servers not healthy: {bad}")
