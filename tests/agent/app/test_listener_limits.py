"""The agent's listeners under attack, on real loopback sockets: what a client can hold.

The agent's own app (`/metrics`, `/healthz`) served by uvicorn with the agent's listener
config. A slowloris, a flood of idle connections, an endless header and a trickled body must
each be cut off, and a scrape must answer within its deadline while they run.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from kvpilot.agent.app.http import build_app
from kvpilot.agent.app.lifecycle import bind_listener
from kvpilot.agent.app.listener_limits import ListenerLimits, listener_config

SCRAPE_DEADLINE_S = 2.0
LIMITS = ListenerLimits(request_deadline_s=1.0, max_waiting=32, keep_alive_s=1)


@dataclass
class Ticks:
    last_tick_at_s: float | None
    ticks_total: int = 1


@pytest.fixture
def port() -> Iterator[int]:
    """The agent's app served from a thread of its own (the test's sockets block)."""
    app = build_app(
        Ticks(time.monotonic()), CollectorRegistry(), clock=time.monotonic, stale_after_s=3600
    )
    sock = bind_listener("127.0.0.1", 0)
    server = uvicorn.Server(listener_config(app, LIMITS))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),))
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def healthz(port: int) -> float:
    """Seconds `/healthz` took to answer 200."""
    started = time.monotonic()
    answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=SCRAPE_DEADLINE_S)
    assert answer.status_code == 200
    return time.monotonic() - started


def connect(port: int, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    if first:
        sock.sendall(first)
    return sock


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server ends this connection within `within_s` (EOF or a reset); an
    answer read first (a 400) counts as ending it when EOF follows."""
    sock.settimeout(within_s)
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            if sock.recv(65536) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def test_slowloris_is_cut_off_and_healthz_answers(port: int) -> None:
    """Headers a byte at a time: each connection is closed once its request is overdue,
    however steadily it sends (uvicorn alone keeps them for ever)."""
    attackers = [connect(port, b"GET /healthz HTTP/1.1\r\nX-Slow: ") for _ in range(20)]
    stop = threading.Event()

    def drip() -> None:
        while not stop.wait(0.1):
            for sock in attackers:
                with contextlib.suppress(OSError):  # closed by the server, as it should be
                    sock.send(b"a")

    dripping = threading.Thread(target=drip)
    dripping.start()
    try:
        assert healthz(port) < SCRAPE_DEADLINE_S
        assert all(closed_by_server(sock, LIMITS.request_deadline_s + 1.0) for sock in attackers)
    finally:
        stop.set()
        dripping.join()
        for sock in attackers:
            sock.close()


def test_idle_flood_pushes_out_the_oldest_and_healthz_answers(port: int) -> None:
    """More idle connections than `max_waiting`: the oldest are closed at once, and the
    flood neither fills `limit_concurrency` (503 for everyone) nor keeps a scraper out."""
    idle = [connect(port) for _ in range(LIMITS.max_waiting * 3)]
    try:
        assert healthz(port) < SCRAPE_DEADLINE_S
        oldest = idle[: LIMITS.max_waiting]
        assert all(closed_by_server(sock, 0.5) for sock in oldest)
    finally:
        for sock in idle:
            sock.close()


def test_an_endless_header_is_refused(port: int) -> None:
    sock = connect(port, b"GET /healthz HTTP/1.1\r\n")
    sent = 0
    try:
        while sent < 4 * 1024 * 1024:
            try:
                sock.sendall(b"X-Endless: " + b"a" * 1000 + b"\r\n")
            except OSError:  # reset or broken pipe: the server closed it
                break
            sent += 1013
        else:
            assert closed_by_server(sock, 1.0), "4 MiB of header taken, the connection open"
    finally:
        sock.close()
    assert healthz(port) < SCRAPE_DEADLINE_S


def test_a_trickled_body_is_cut_off(port: int) -> None:
    """A request whose head is whole but whose body never ends holds no request for ever."""
    sock = connect(port, b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
    try:
        for _ in range(5):
            try:
                sock.send(b"a")
            except OSError:
                break
            time.sleep(0.05)
        assert closed_by_server(sock, LIMITS.request_deadline_s + 1.0)
    finally:
        sock.close()


def test_keep_alive_connections_get_a_fresh_deadline_per_request(port: int) -> None:
    """The deadline runs per request: a client making prompt requests on one connection is
    never cut off for the connection's age (here twice the deadline)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=SCRAPE_DEADLINE_S)
    try:
        for _ in range(5):
            connection.request("GET", "/healthz")
            answer = connection.getresponse()  # RemoteDisconnected had it been cut off
            answer.read()
            assert answer.status == 200
            time.sleep(LIMITS.request_deadline_s / 2)
    finally:
        connection.close()
