"""A reverse proxy for end-to-end tests: forwards every request to a real server, with a hook per reply.

A test that must act at a fixed point of a run (replace weights right after the trainer labels a version, answer a
request the way a broken server would) does it here, in the request path, instead of racing the trainer from a
thread. ``hook(path, body, reply) -> reply | (status, content) | None`` runs after the upstream answered; a tuple
replaces the reply. ``request_hook(path, body) -> body | (status, content)`` (optional) may rewrite a request before
it is forwarded (``hook`` then sees the forwarded body), or answer it itself with a tuple (not forwarded, no hook).
"""

from __future__ import annotations

import http.server
import sys
import threading
from collections.abc import Callable
from typing import Self

import httpx

Hook = Callable[[str, bytes, httpx.Response], "tuple[int, bytes] | None"]
RequestHook = Callable[[str, bytes], "bytes | tuple[int, bytes]"]


class Proxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str, hook: Hook, request_hook: RequestHook | None = None):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream, self.hook = upstream, hook
        self.request_hook = request_hook or (lambda path, body: body)
        self.http = httpx.Client(timeout=600)
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def handle_error(self, request, client_address) -> None:
        """A client that hung up (a batch aborted after a refusal) is no error of the proxy's."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
        self.http.close()


class _Forward(http.server.BaseHTTPRequestHandler):
    def _forward(self) -> None:
        body = self.server.request_hook(self.path, self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        if isinstance(body, tuple):  # answered by the request hook itself
            status, content, content_type = *body, None
        else:
            headers = {
                k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")
            }
            url = self.server.upstream + self.path
            reply = self.server.http.request(self.command, url, content=body, headers=headers)
            status, content = self.server.hook(self.path, body, reply) or (reply.status_code, reply.content)
            content_type = reply.headers.get("Content-Type")
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    do_GET = do_POST = do_PUT = do_DELETE = _forward

    def log_message(self, *args) -> None:
        pass
