"""A real loopback HTTP server whose routes misbehave on purpose: a body that drips a byte at
a time and never ends, a body far larger than any limit streamed from a generator, and
answers that change from one request to the next.

It uses only the standard library, so the fault tests that drive `kvpilot` from the outside
can run against any version of it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

Writer = Callable[[BaseHTTPRequestHandler, "Misbehaving"], None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answer(body: bytes, content_type: str = "text/plain; version=0.0.4") -> Writer:
    """A plain 200 with `body`."""

    def write(handler: BaseHTTPRequestHandler, _: Misbehaving) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return write


def late(delay_s: float, body: bytes) -> Writer:
    """A plain 200 with `body`, after `delay_s` of silence."""

    def write(handler: BaseHTTPRequestHandler, server: Misbehaving) -> None:
        if not server.closing.wait(delay_s):
            answer(body)(handler, server)

    return write


def answers(bodies: Sequence[bytes]) -> Writer:
    """The n-th request gets the n-th body (the last one from then on)."""
    lock = threading.Lock()
    served = [0]

    def write(handler: BaseHTTPRequestHandler, server: Misbehaving) -> None:
        with lock:
            body = bodies[min(served[0], len(bodies) - 1)]
            served[0] += 1
        answer(body)(handler, server)

    return write


def drip(every_s: float = 0.3, head: bytes = b"# HELP kvpool_blocks_free Free blocks.\n") -> Writer:
    """Headers at once, then one byte every `every_s` for ever: each read is quick, the body
    never ends. Stops when the client goes away or the server closes."""

    def write(handler: BaseHTTPRequestHandler, server: Misbehaving) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain; version=0.0.4")
        handler.end_headers()  # no Content-Length: the body ends when the connection does
        handler.wfile.flush()
        i = 0
        while not server.closing.wait(every_s):
            try:
                handler.wfile.write(head[i % len(head) : i % len(head) + 1])
                handler.wfile.flush()
            except OSError:
                return
            i += 1

    return write


def endless(total_bytes: int, chunk: bytes, status: int = 200) -> Writer:
    """`total_bytes` of body made by a generator, `chunk` after `chunk`, with no
    Content-Length; records, per request, what was written before the client stopped."""

    def pieces() -> Iterator[bytes]:
        left = total_bytes
        while left > 0:
            piece = chunk[:left]
            left -= len(piece)
            yield piece

    def write(handler: BaseHTTPRequestHandler, server: Misbehaving) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "text/plain; version=0.0.4")
        handler.end_headers()
        written = 0
        try:
            for piece in pieces():
                if server.closing.is_set():
                    return
                handler.wfile.write(piece)
                written += len(piece)
        except OSError:
            return
        finally:
            server.record_written(handler.path, written)

    return write


class Misbehaving:
    """Serves `routes` (path -> writer; unknown paths get a 404) from a thread inside `with`,
    to GET and POST alike (a POST's body is read first); records when each request arrived."""

    def __init__(self, routes: dict[str, Writer]) -> None:
        self.routes = routes
        self.closing = threading.Event()
        self.arrivals: defaultdict[str, list[float]] = defaultdict(list)
        self.written: defaultdict[str, list[int]] = defaultdict(list)  # bytes, per request
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with outer._lock:
                    outer.arrivals[self.path].append(time.monotonic())
                writer = outer.routes.get(self.path)
                if writer is None:
                    self.send_error(404)
                    return
                writer(self, outer)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.do_GET()

            def log_message(self, *args: object) -> None:
                """Quiet."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True  # a dripping answer never holds up the exit
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,))
        self._thread.daemon = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def record_written(self, path: str, n: int) -> None:
        with self._lock:
            self.written[path].append(n)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
