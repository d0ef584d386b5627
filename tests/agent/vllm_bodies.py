"""A loopback HTTP server that answers `/metrics` with recorded vLLM bodies, one after the
other (the last one repeats): a server whose counters advance between scrapes. It stands in
for vLLM where a test needs only its /metrics text."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from tests.http_helpers import ServedInThread

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def recorded(*names: str) -> list[str]:
    return [(FIXTURES / name).read_text() for name in names]


def metrics_server(bodies: Sequence[str]) -> ServedInThread:
    """Serve `bodies` to successive GET /metrics (404 for anything else)."""
    lock = threading.Lock()
    left = list(bodies)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            with lock:
                body = (left.pop(0) if len(left) > 1 else left[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return ServedInThread(Handler)
