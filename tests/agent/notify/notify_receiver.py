"""A real HTTP receiver on a loopback port: records requests, answers as a test tells it."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvpilot.agent.notify.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify_signature
from kvpilot.rig.server import free_port


@dataclass(frozen=True, slots=True)
class Received:
    """One request as it arrived, and the status it was answered with."""

    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes
    status: int
    signature_ok: bool | None  # None when the receiver has no secret

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def accepted(self) -> bool:
        return 200 <= self.status < 300


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that gave up (timeout tests) breaks the pipe: expected, not news."""


class Receiver:
    """Answers 200 unless told otherwise (`answer`), hangs on `hang()` (or only for one alert,
    `hang_alert`), takes its time on `slow()`, is down after `stop()`.

    With a `secret`, it checks every request's HMAC signature with `verify_signature` and
    answers 401 to a bad one, as a real receiver would.
    """

    def __init__(self, *, secret: str | None = None, now: Callable[[], float] = time.time) -> None:
        self.port = free_port()
        self.secret = secret
        self.now = now
        self._lock = threading.Lock()
        self._received: list[Received] = []
        self._script: deque[tuple[int, dict[str, str]]] = deque()
        self._default: tuple[int, dict[str, str]] = (200, {})
        self._release = threading.Event()
        self._release.set()
        self._held_alerts: set[str] = set()  # fingerprints whose requests are held
        self._delay_s = 0.0  # before each answer (`slow`)
        self._stopping = threading.Event()  # cuts a delay short at `stop()`
        self._arrived: list[str] = []  # dedup keys as requests came in, before any hold
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Receiver:
        self._stopping.clear()
        server = _QuietServer(("127.0.0.1", self.port), self._handler_class())
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Down: the port refuses connections until `start()` again."""
        self._release.set()
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def answer(self, status: int, *, times: int | None = None, **headers: str) -> None:
        """Answer `status` to the next `times` requests; None: to all after those scripted."""
        with self._lock:
            if times is None:
                self._default = (status, headers)
            else:
                self._script.extend([(status, headers)] * times)

    def hang(self) -> None:
        """Hold every request until `release()` (or `stop()`), to make clients time out."""
        self._release.clear()

    def hang_alert(self, fingerprint: str) -> None:
        """Hold the requests about one alert until `release()`; answer the others."""
        with self._lock:
            self._held_alerts.add(fingerprint)
        self._release.clear()

    def slow(self, delay_s: float) -> None:
        """Take `delay_s` over each answer from now on (0: answer at once)."""
        with self._lock:
            self._delay_s = delay_s

    def release(self) -> None:
        with self._lock:
            self._held_alerts.clear()
        self._release.set()

    def arrived(self) -> list[str]:
        """The dedup keys of every request as it came in, answered or still held."""
        with self._lock:
            return list(self._arrived)

    def _held(self, dedup_key: str) -> bool:
        with self._lock:
            if not self._held_alerts:
                return True  # hang(): every request
            return dedup_key.split(":", 1)[0] in self._held_alerts

    def received(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    def accepted(self) -> list[Received]:
        return [r for r in self.received() if r.accepted]

    def _next_answer(self) -> tuple[int, dict[str, str]]:
        with self._lock:
            return self._script.popleft() if self._script else self._default

    def _record(self, received: Received) -> None:
        with self._lock:
            self._received.append(received)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                key = headers.get("x-kvpilot-dedup-key", "")
                with receiver._lock:
                    receiver._arrived.append(key)
                if receiver._held(key):
                    receiver._release.wait(timeout=30)
                with receiver._lock:
                    delay_s = receiver._delay_s
                if delay_s > 0:
                    receiver._stopping.wait(timeout=delay_s)
                status, extra = receiver._next_answer()
                signature_ok = None
                if receiver.secret is not None:
                    signature_ok = verify_signature(
                        receiver.secret,
                        headers.get(TIMESTAMP_HEADER.lower(), ""),
                        body,
                        headers.get(SIGNATURE_HEADER.lower()),
                        receiver.now(),
                    )
                    if not signature_ok and 200 <= status < 300:
                        status = 401
                receiver._record(Received("POST", self.path, headers, body, status, signature_ok))
                reply = b"ok" if status < 300 else f"status {status}".encode()
                self.send_response(status)
                for name, value in extra.items():
                    self.send_header(name.replace("_", "-"), value)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                """Quiet: the test reads `received()` instead."""

        return Handler
