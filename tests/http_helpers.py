"""What the tests' small HTTP servers share: a JSON reply, and a server on a thread."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


def send_json(handler: BaseHTTPRequestHandler, status: int, body: object) -> None:
    """Answer the request with `body` as JSON."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class ServedInThread:
    """A ThreadingHTTPServer on loopback, served from a daemon thread inside `with`."""

    def __init__(
        self, handler: type[BaseHTTPRequestHandler], port: int = 0, host: str = "127.0.0.1"
    ) -> None:
        self._server = ThreadingHTTPServer((host, port), handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
