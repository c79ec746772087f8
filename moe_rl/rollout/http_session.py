"""The HTTP layer of the rollout client's ``/generate`` requests: one pooled aiohttp session per batch.

Owns the session a batch's requests share (``max_concurrency`` keep-alive connections, the request timeout per
connect, the client's headers, the environment's proxy for each server as httpx reads it), its ``post_json``:
``(status, body bytes)``, or ``TransportFailure`` when no reply came (refused, reset, timed out, closed mid-reply),
and ``post_generate``, the bound on one ``/generate`` request (``rollout.request_timeout_s``): a request still
running at its bound is not cut -- that would lose what it generated -- but aborted on its server by its ``rid``
(``/abort_request``), and its reply, which then carries the tokens generated so far, comes back marked
``bound_hit`` for the client to continue (``moe_rl.rollout.partial``). A server that sends no reply within
``grace_s`` of the abort is a ``TransportFailure`` (the request is sent again). What a status or a body means is
``moe_rl.rollout.replies``'s.

aiohttp for this path, httpx for the one-off admin calls: a request costs the client ~0.2 ms of CPU with aiohttp
and ~1.4 ms with httpx (``bench/bench_http_client.py``); at 128 requests a step that was ~0.2 s of CPU per step
in the async rollout process, which shares two cores with the learner and the server (docs/benchmarks.md). The
proxy is looked up once per server and batch: aiohttp's ``trust_env`` looks it up (and reads ``~/.netrc``) in a
worker thread for every request, ~9% of the rollout process's CPU under py-spy.
"""

from __future__ import annotations

import asyncio
import contextlib
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
            # no read timeout: a /generate reply is bounded by post_generate, which aborts instead of cutting it
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=None),
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

    async def post_json(self, url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """POST ``body`` as JSON; the reply's status and body (TransportFailure when none came)."""
        target = URL(url)
        proxy, proxy_auth = self._proxy(target)
        try:
            async with self._http.post(target, json=body, proxy=proxy, proxy_auth=proxy_auth, headers=headers) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as err:
            raise TransportFailure(f"{type(err).__name__}: {err}") from err

    async def post_generate(
        self, server: str, body: dict, bound_s: float, grace_s: float, admin_headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, bool]:
        """POST ``body`` (with its ``rid``) to ``{server}/generate``: ``(status, body, bound_hit)``. Past ``bound_s``
        the request is aborted on the server (``/abort_request {rid}``, with ``admin_headers``) and its reply read
        (``bound_hit`` True); none within ``grace_s`` after that is a TransportFailure."""
        reply = asyncio.ensure_future(self.post_json(f"{server}/generate", body))
        try:
            done, _ = await asyncio.wait({reply}, timeout=bound_s)
            if done:
                return (*reply.result(), False)
            status, raw = await self.post_json(f"{server}/abort_request", {"rid": body["rid"]}, admin_headers)
            if status >= 400:
                raise TransportFailure(
                    f"a request past its {bound_s:g} s bound (rollout.request_timeout_s) could not be aborted: "
                    f"{server}/abort_request answered HTTP {status}: {raw[:200].decode(errors='replace')}"
                )
            done, _ = await asyncio.wait({reply}, timeout=grace_s)
            if not done:
                raise TransportFailure(
                    f"no reply {grace_s:g} s after aborting a request past its {bound_s:g} s bound "
                    "(rollout.request_timeout_s)"
                )
            return (*reply.result(), True)
        finally:
            if not reply.done():
                reply.cancel()
                with contextlib.suppress(asyncio.CancelledError, TransportFailure):
                    await reply
