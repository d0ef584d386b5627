"""The plugin's exposition under attack, on real loopback sockets: what a client can hold.

It runs inside vLLM's engine process: slow, idle or endless clients must hold neither its
threads nor its memory, and a scrape must still answer within its deadline meanwhile.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvpilot.collectors.kvpool.bounded_http import ConnectionLimits
from kvpilot.collectors.kvpool.server import KvPoolCollector, PartErrors, RunningServer, serve

SCRAPE_DEADLINE_S = 2.0
LIMITS = ConnectionLimits(head_deadline_s=1.0, max_waiting=32)


@pytest.fixture
def server() -> Iterator[RunningServer]:
    collector = KvPoolCollector(
        engines=list, allocators=list, errors=PartErrors(), clock=time.monotonic
    )
    running = serve(collector, "127.0.0.1", 0, LIMITS)
    yield running
    running.close()


def scrape(server: RunningServer) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=SCRAPE_DEADLINE_S)


def connect(server: RunningServer, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5.0)
    if first:
        sock.sendall(first)
    return sock


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server ends this connection within `within_s` (EOF or a reset)."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_normal_scrape_answers(server: RunningServer) -> None:
    answer = scrape(server)
    assert answer.status_code == 200
    assert "kvpool_plugin_errors" in answer.text


def test_slowloris_holds_no_threads_and_the_scrape_answers(server: RunningServer) -> None:
    """200 connections sending a header a byte at a time: one thread per connection (as
    prometheus_client's own server does) would be 200 threads in the engine process."""
    threads_before = threading.active_count()
    attackers = [connect(server, b"GET /metrics HTTP/1.1\r\nX-Slow: ") for _ in range(200)]
    stop = threading.Event()

    def drip() -> None:
        while not stop.wait(0.1):
            for sock in attackers:
                with contextlib.suppress(OSError):  # closed by the server, as it should be
                    sock.send(b"a")

    dripping = threading.Thread(target=drip)
    dripping.start()
    try:
        started = time.monotonic()
        assert scrape(server).status_code == 200
        assert time.monotonic() - started < SCRAPE_DEADLINE_S
        assert threading.active_count() <= threads_before + 1  # + the dripping thread
        # Past the deadline for its head every slow connection has been closed.
        assert all(closed_by_server(sock, LIMITS.head_deadline_s + 1.0) for sock in attackers)
        assert scrape(server).status_code == 200
    finally:
        stop.set()
        dripping.join()
        for sock in attackers:
            sock.close()


def test_idle_connections_are_capped_and_a_scrape_still_gets_in(server: RunningServer) -> None:
    """Connections that send nothing: beyond `max_waiting` the oldest are closed at once, so a
    flood cannot fill the process's descriptors nor keep a scraper out."""
    threads_before = threading.active_count()
    idle = [connect(server) for _ in range(LIMITS.max_waiting * 4)]
    try:
        assert scrape(server).status_code == 200
        assert threading.active_count() <= threads_before
        oldest = idle[: LIMITS.max_waiting * 2]
        assert all(closed_by_server(sock, 0.5) for sock in oldest)
    finally:
        for sock in idle:
            sock.close()


def test_an_endless_header_is_cut_off() -> None:
    """A head past the cap is closed on its size, not on its deadline: the deadline here is
    far away. (How many bytes the client gets to send first is the kernel's socket buffers'
    business, which autotuning grows on a busy machine: the test sends a fixed 64 KiB.)"""
    collector = KvPoolCollector(
        engines=list, allocators=list, errors=PartErrors(), clock=time.monotonic
    )
    server = serve(collector, "127.0.0.1", 0, ConnectionLimits(head_deadline_s=60.0))
    sock = connect(server, b"GET /metrics HTTP/1.1\r\n")
    line = b"X-Endless: " + b"a" * 1000 + b"\r\n"
    try:
        with contextlib.suppress(OSError):  # reset or broken pipe: closed already
            for _ in range(64):
                sock.sendall(line)
        sock.settimeout(10.0)
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            closed = False
        assert closed, "a head past the cap was kept open"
        assert scrape(server).status_code == 200
    finally:
        sock.close()
        server.close()


def test_a_client_that_never_reads_its_answer_holds_no_worker(server: RunningServer) -> None:
    """Complete requests that never read: the workers close them after the write, and the
    queue past its bound is closed at once; a scrape still answers."""
    readers = [connect(server, b"GET /metrics HTTP/1.0\r\n\r\n") for _ in range(50)]
    try:
        assert scrape(server).status_code == 200
    finally:
        for sock in readers:
            sock.close()
