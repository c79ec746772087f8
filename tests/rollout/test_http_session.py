"""The rollout client's HTTP session (``moe_rl.rollout.http_session``) against a real local HTTP server.

The client moved its ``/generate`` requests from httpx to aiohttp for their CPU cost; what httpx did for it stays:
the environment's proxy (unless ``NO_PROXY`` names the host), the request timeout per read, the client's headers,
and a transport failure as one ``TransportFailure``.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from moe_rl.rollout.http_session import Session, TransportFailure
from moe_rl.rollout.ports import free_port

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


async def _echo(request: web.Request) -> web.Response:
    body = await request.json()
    await asyncio.sleep(float(body.get("sleep", 0)))
    return web.json_response({"echo": body, "key": request.headers.get("X-Key")})


def _serve(check):
    """Run ``check(url)`` against a local echo server (its /generate), in one event loop."""

    async def main():
        app = web.Application()
        app.router.add_post("/generate", _echo)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            await check(f"http://127.0.0.1:{port}/generate")
        finally:
            await runner.cleanup()

    asyncio.run(main())


@pytest.fixture
def no_proxies(monkeypatch):
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


def test_the_environment_proxy_is_used_unless_no_proxy_names_the_host(no_proxies, device):
    async def check(url):
        no_proxies.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")  # a proxy nobody listens on
        async with Session(2, 10.0, {}) as http:
            with pytest.raises(TransportFailure, match="ClientProxyConnectionError|ClientConnectorError"):
                await http.post_json(url, {"a": 1})
        no_proxies.setenv("NO_PROXY", "127.0.0.1")
        async with Session(2, 10.0, {"X-Key": "k"}) as http:
            status, raw = await http.post_json(url, {"a": 1})
        assert status == 200 and json.loads(raw) == {"echo": {"a": 1}, "key": "k"}

    _serve(check)


def test_a_reply_slower_than_the_timeout_is_a_transport_failure(no_proxies, device):
    async def check(url):
        async with Session(2, 0.5, {}) as http:
            assert (await http.post_json(url, {"sleep": 0.1}))[0] == 200
            with pytest.raises(TransportFailure, match="Timeout"):
                await asyncio.wait_for(http.post_json(url, {"sleep": 3.0}), 2.5)

    _serve(check)
