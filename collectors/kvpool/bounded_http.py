"""A small HTTP server for prometheus_client's exposition that bounds what a client can hold.

It runs inside vLLM's engine process, so a client must never be able to hold its threads or
its memory. One selector thread reads every request head without blocking, each under a
deadline and a size cap; at most `max_waiting` connections may wait for their head, and a new
one pushes the oldest out (a flood of idle or slow connections cannot shut out a scraper
whose request arrives at once). Complete heads go to a fixed pool of worker threads through
a bounded queue; a worker answers with prometheus_client's own `MetricsHandler`, under a
write timeout, and closes the connection. Threads: one plus `workers`, whatever the clients do.
"""

from __future__ import annotations

import contextlib
import io
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler

log = logging.getLogger("kvpilot.kvpool")

_HEAD_END = (b"\r\n\r\n", b"\n\n")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one client may hold; the defaults suit a scraper polling every few seconds."""

    head_deadline_s: float = 5.0  # from accept until the blank line that ends the head
    max_head_bytes: int = 8 * 1024  # request line and headers together
    max_waiting: int = 64  # connections still sending their head; the oldest goes first
    workers: int = 2  # threads answering complete requests
    max_queued: int = 8  # complete requests waiting for a worker; more are closed
    write_timeout_s: float = 5.0  # for a client that does not read its answer


@dataclass(slots=True)
class _Waiting:
    deadline_s: float
    head: bytearray


class _PrefetchedHandler(MetricsHandler):
    """prometheus_client's handler, fed the head already read instead of the socket."""

    def __init__(
        self,
        head: bytes,
        registry: CollectorRegistry,
        conn: socket.socket,
        address: tuple[str, int],
        server: BoundedHttpServer,
    ) -> None:
        self._head = head
        self.registry = registry
        super().__init__(conn, address, server)  # type: ignore[arg-type]  # only kept, not used

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's reader: closing it lets the socket close for real
        self.rfile = io.BytesIO(self._head)


class BoundedHttpServer:
    """Serves `registry` on `sock` (bound and listening) until `close()`; never raises from
    its threads: an unexpected error is handed to `on_error` and the connection dropped."""

    def __init__(
        self,
        sock: socket.socket,
        registry: CollectorRegistry,
        *,
        limits: ConnectionLimits = ConnectionLimits(),
        on_error: Callable[[BaseException], None] = lambda exc: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sock = sock
        self._registry = registry
        self._limits = limits
        self._on_error = on_error
        self._clock = clock
        self._stopping = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, _Waiting] = {}  # in arrival order: oldest first
        self._ready: queue.Queue[tuple[socket.socket, tuple[str, int], bytes] | None] = queue.Queue(
            maxsize=limits.max_queued
        )
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)
        self._threads = [threading.Thread(target=self._read_heads, name="kvpool-http", daemon=True)]
        self._threads += [
            threading.Thread(target=self._answer, name=f"kvpool-http-{n}", daemon=True)
            for n in range(limits.workers)
        ]

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Stops accepting, drops every connection and waits briefly for the threads."""
        self._stopping.set()
        for _ in range(self._limits.workers):
            with contextlib.suppress(queue.Full):
                self._ready.put(None, timeout=1.0)
        for thread in self._threads:
            thread.join(timeout=5.0)
        for conn in list(self._waiting):
            self._drop(conn)
        self._selector.close()
        self._sock.close()

    # The selector thread: accepts, reads heads, enforces the deadline and the cap.

    def _read_heads(self) -> None:
        while not self._stopping.is_set():
            try:
                for key, _ in self._selector.select(timeout=0.2):
                    if key.fileobj is self._sock:
                        self._accept()
                    else:
                        assert isinstance(key.fileobj, socket.socket)
                        self._read(key.fileobj)
                self._expire()
            except Exception as exc:  # never let one client end the serving thread
                self._on_error(exc)

    def _accept(self) -> None:
        for _ in range(self._limits.max_waiting):  # a burst is taken in rounds, not at once
            try:
                conn, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the oldest waiting ones make room
                log.debug("kvpool: accept failed: %s", exc)
                self._drop_oldest()
                return
            conn.setblocking(False)
            self._selector.register(conn, selectors.EVENT_READ, address)
            self._waiting[conn] = _Waiting(
                self._clock() + self._limits.head_deadline_s, bytearray()
            )
            while len(self._waiting) > self._limits.max_waiting:
                self._drop_oldest()

    def _read(self, conn: socket.socket) -> None:
        waiting = self._waiting.get(conn)
        if waiting is None:
            return
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        waiting.head += data
        if any(end in waiting.head for end in _HEAD_END):
            address = self._selector.unregister(conn).data
            del self._waiting[conn]
            try:
                self._ready.put_nowait((conn, address, bytes(waiting.head)))
            except queue.Full:  # the workers are behind: this client asks again later
                conn.close()
        elif len(waiting.head) > self._limits.max_head_bytes:
            self._drop(conn)

    def _expire(self) -> None:
        now_s = self._clock()
        while self._waiting:
            conn, waiting = next(iter(self._waiting.items()))
            if waiting.deadline_s > now_s:
                return  # all share one deadline length, so the rest are younger
            self._drop(conn)

    def _drop_oldest(self) -> None:
        if self._waiting:
            self._drop(next(iter(self._waiting)))

    def _drop(self, conn: socket.socket) -> None:
        self._waiting.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()

    # The workers: one complete request each, answered by prometheus_client.

    def _answer(self) -> None:
        while True:
            item = self._ready.get()
            if item is None or self._stopping.is_set():
                if item is not None:
                    item[0].close()
                return
            conn, address, head = item
            try:
                conn.setblocking(True)
                conn.settimeout(self._limits.write_timeout_s)
                _PrefetchedHandler(head, self._registry, conn, address, self)
            except OSError:
                pass  # the client went away or stopped reading: nothing of ours failed
            except Exception as exc:
                self._on_error(exc)
            finally:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (IPv4 or IPv6 as the host is); OSError if taken."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock
