"""The HTTP layer of the rollout client's ``/generate`` requests: one pooled aiohttp session per batch.

Owns the session a batch's requests share (``max_concurrency`` keep-alive connections, the request timeout per
connect and per read as httpx counts them, the client's headers, the environment's proxy for each server as httpx
reads it) and its ``post_json``: ``(status, body bytes)``, or ``TransportFailure`` when no reply came (refused,
reset, timed out, closed mid-reply). What a status or a body means is ``moe_rl.rollout.replies``'s.

aiohttp for this path, httpx for the one-off admin calls: a request costs the client ~0.2 ms of CPU with aiohttp
and ~1.4 ms with httpx (``bench/bench_http_client.py``); at 128 requests a step that was ~0.2 s of CPU per step
in the async rollout process, which shares two cores with the learner and the server (docs/benchmarks.md). The
proxy is looked up once per server and batch: aiohttp's ``trust_env`` looks it up (and reads ``~/.netrc``) in a
worker thread for every request, ~9% of the rollout process's CPU under py-spy.
"""

from __future__ import annotations

from typing import Self

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

__all__ = ["Session", "TransportFailure"]


class TransportFailure(Exception):
    """No HTTP reply (connection refused or reset, a timeout, a reply cut short); the message says which."""


class Session:
    """A batch's connections (``async with``, inside the batch's event loop)."""

    def __init__(self, max_concurrency: int, timeout_s: float, headers: dict[str, str]):
        self._args = (max_concurrency, timeout_s, dict(headers))
        self._http: aiohttp.ClientSession | None = None
        self._proxies: dict[tuple, tuple] = {}  # (scheme, host, port) -> (proxy URL or None, its auth)

    async def __aenter__(self) -> Self:
        limit, timeout_s, headers = self._args
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s),
            headers=headers,
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.close()

    def _proxy(self, url: URL) -> tuple:
        key = (url.scheme, url.host, url.port)
        if key not in self._proxies:
            try:
                self._proxies[key] = get_env_proxy_for_url(url)  # HTTP(S)_PROXY unless NO_PROXY names the host
            except LookupError:
                self._proxies[key] = (None, None)
        return self._proxies[key]

    async def post_json(self, url: str, body: dict) -> tuple[int, bytes]:
        """POST ``body`` as JSON; the reply's status and body (TransportFailure when none came)."""
        target = URL(url)
        proxy, proxy_auth = self._proxy(target)
        try:
            async with self._http.post(target, json=body, proxy=proxy, proxy_auth=proxy_auth) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as err:
            raise TransportFailure(f"{type(err).__name__}: {err}") from err
