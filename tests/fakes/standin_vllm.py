"""A stand-in for vLLM's HTTP API (/health, /v1/models, /v1/completions), for the probe step,
and /metrics (whatever text `metrics()` returns at each scrape; empty by default).

A completion with `"stream": true` is answered with server-sent events, as vLLM's is.
`host` binds another loopback address (127.0.0.N) so that pods on one port are told apart.

The pods of the fake API server point at 127.0.0.1; this answers there. The real vLLM is
covered by the runtime contract tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

from tests.http_helpers import ServedInThread, send_json


class StandInVllm(ServedInThread):
    """Answers the readiness probe like a healthy vLLM serving one model."""

    def __init__(self, model: str = "stand-in", host: str = "127.0.0.1", port: int = 0) -> None:
        self.model = model
        self.completions_total = 0
        self.metrics: Callable[[], str] = lambda: ""
        self.metrics_scrapes = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, payload: object) -> None:
                send_json(self, code, payload)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": server.model}]})
                elif self.path == "/metrics":
                    server.metrics_scrapes += 1
                    data = server.metrics().encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._send(404, {})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                server.completions_total += 1
                tokens = int(body.get("max_tokens") or 1)
                if body.get("stream"):
                    self._stream(tokens)
                    return
                self._send(
                    200,
                    {"choices": [{"text": "x" * tokens}], "usage": {"completion_tokens": tokens}},
                )

            def _stream(self, tokens: int) -> None:
                """Server-sent events, one token each, as vLLM streams a completion."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("X-Served-By", f"{host}:{server.port}")
                self.end_headers()
                for _ in range(tokens):
                    event = {"model": server.model, "choices": [{"text": "x"}]}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args: object) -> None:
                """Quiet."""

        super().__init__(Handler, port, host)
