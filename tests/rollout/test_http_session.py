"""The rollout client's HTTP session (``moe_rl.rollout.http_session``) against a real local HTTP server.

The client moved its ``/generate`` requests from httpx to aiohttp for their CPU cost; what httpx did for it stays:
the environment's proxy (unless ``NO_PROXY`` names the host), the client's headers, and a transport failure as one
``TransportFailure``. A ``/generate`` past its bound is not cut but aborted on the server by its ``rid`` and its reply
read (``post_generate``): the server here holds a held request until that abort arrives, so nothing races.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp import web

from moe_rl.rollout.http_session import Session, TransportFailure
from moe_rl.rollout.ports import free_port

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


def _serve(check, honour_aborts=True, abort_status=200):
    """Run ``check(url, state)`` against a local echo server (its /generate, /abort_request), in one event loop;
    ``state.abort_calls``: the (body, X-Key) of each /abort_request."""
    state = SimpleNamespace(aborted={}, abort_calls=[])

    async def echo(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(float(body.get("sleep", 0)))
        if body.get("hold"):  # held until /abort_request names its rid (or forever: a server that ignores aborts)
            await state.aborted.setdefault(body["rid"], asyncio.Event()).wait()
            return web.json_response({"aborted": body["rid"]})
        return web.json_response({"echo": body, "key": request.headers.get("X-Key")})

    async def abort(request: web.Request) -> web.Response:
        body = await request.json()
        state.abort_calls.append((body, request.headers.get("X-Key")))
        if abort_status != 200:
            return web.Response(status=abort_status, text="admin key required")
        if honour_aborts:
            state.aborted.setdefault(body["rid"], asyncio.Event()).set()
        return web.Response(status=200)

    async def main():
        app = web.Application()
        app.router.add_post("/generate", echo)
        app.router.add_post("/abort_request", abort)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            await check(f"http://127.0.0.1:{port}", state)
        finally:
            for event in state.aborted.values():  # release a request still held: the server stops at once
                event.set()
            await runner.cleanup()

    asyncio.run(main())


@pytest.fixture
def no_proxies(monkeypatch):
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


def test_the_environment_proxy_is_used_unless_no_proxy_names_the_host(no_proxies, device):
    async def check(server, app):
        url = f"{server}/generate"
        no_proxies.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")  # a proxy nobody listens on
        async with Session(2, 10.0, {}) as http:
            with pytest.raises(TransportFailure, match="ClientProxyConnectionError|ClientConnectorError"):
                await http.post_json(url, {"a": 1})
        no_proxies.setenv("NO_PROXY", "127.0.0.1")
        async with Session(2, 10.0, {"X-Key": "k"}) as http:
            status, raw = await http.post_json(url, {"a": 1})
        assert status == 200 and json.loads(raw) == {"echo": {"a": 1}, "key": "k"}

    _serve(check)


def test_a_request_past_its_bound_is_aborted_by_rid_and_its_reply_read(no_proxies, device):
    """A quick reply comes back as it is; a held one is aborted at the bound (with the admin key) and its reply kept,
    however long the generation ran: no read timeout cuts it."""

    async def check(server, app):
        async with Session(2, 10.0, {"X-Key": "api"}) as http:
            status, raw, hit = await http.post_generate(server, {"rid": "r1", "sleep": 0.05}, 5.0, 5.0)
            assert (status, hit, app.abort_calls) == (200, False, [])
            status, raw, hit = await http.post_generate(server, {"rid": "r2", "hold": True}, 0.2, 5.0, {"X-Key": "adm"})
        assert (status, json.loads(raw), hit) == (200, {"aborted": "r2"}, True)
        assert app.abort_calls == [({"rid": "r2"}, "adm")]

    _serve(check)


@pytest.mark.parametrize(
    ("honour", "status", "message"),
    [(False, 200, r"no reply 0.3 s after aborting a request past its 0.2 s bound"), (True, 401, r"HTTP 401")],
    ids=["abort-ignored", "abort-refused"],
)
def test_a_server_that_does_not_end_a_request_past_its_bound_is_a_transport_failure(
    no_proxies, device, honour, status, message
):
    async def check(server, app):
        async with Session(2, 10.0, {}) as http:
            with pytest.raises(TransportFailure, match=message):
                await http.post_generate(server, {"rid": "r3", "hold": True}, 0.2, 0.3)
        assert [call for call, _ in app.abort_calls] == [{"rid": "r3"}]

    _serve(check, honour_aborts=honour, abort_status=status)
