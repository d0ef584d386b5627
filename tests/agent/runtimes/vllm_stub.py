"""A stand-in vLLM server process: vLLM's command line, and answers to the readiness probe.

Run a copy of this file named `vllm`: `python DIR/vllm serve MODEL [--host H] [--port P] ...`
is the `vllm serve` launch form as /proc shows it. It answers /health, /v1/models and
/v1/completions on --port at --host (loopback when --host is absent or a wildcard); when that
address is taken (a second server claiming it) it only waits. Once set up it creates the file
named by STUB_READY_FILE. With STUB_METRICS_FILE it serves that recorded payload on /metrics
(and vLLM 0.32.0 on /version). SIGTERM ends it; SIGUSR1 makes it exec a process that no longer looks
like vLLM (same PID, same start time).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

WILDCARDS = {"", "0.0.0.0", "::"}  # recognised, never bound


def option(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def handler_for(model: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, payload: object) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            metrics = os.environ.get("STUB_METRICS_FILE")
            if self.path == "/metrics" and metrics:
                data = Path(metrics).read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path == "/version" and metrics:
                self._send(200, {"version": "0.32.0"})
            elif self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"data": [{"id": model}]})
            else:
                self._send(404, {})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            tokens = int(body.get("max_tokens") or 1)
            self._send(
                200, {"choices": [{"text": "x" * tokens}], "usage": {"completion_tokens": tokens}}
            )

        def log_message(self, *args: object) -> None:
            """Quiet."""

    return Handler


def become_something_else(_signum: int, _frame: object) -> None:
    # Same PID, same start time, a command line that is no vLLM server.
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)"])  # noqa: S606


def main() -> None:
    args = sys.argv[1:]
    signal.signal(signal.SIGUSR1, become_something_else)
    host = option(args, "--host") or ""
    host = "127.0.0.1" if host.strip("[]") in WILDCARDS else host.strip("[]")
    port = int(option(args, "--port") or 8000)
    try:
        server = ThreadingHTTPServer((host, port), handler_for(args[1]))
    except OSError:
        server = None  # the address is another server's
    else:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    ready = os.environ.get("STUB_READY_FILE")
    if ready:
        Path(ready).touch()
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
