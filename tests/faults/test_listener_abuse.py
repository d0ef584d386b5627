"""The demo's webhook receiver under attack, on real loopback sockets.

It is a listener like the agent's own: a body without end must be refused once past its cap
(never read whole into memory first), and a slow client cut off at the request deadline.
"""

from __future__ import annotations

import asyncio
import socket
import time

from kvpilot.agent.app.listener_limits import ListenerLimits
from kvpilot.agent.cli.demo.receiver import MAX_BODY_BYTES, WebhookReceiver

LIMITS = ListenerLimits(request_deadline_s=1.0)


def _post_without_end(port: int) -> bytes:
    """A POST that declares a gigabyte and streams until answered; what came back first."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    try:
        sock.sendall(b"POST /alerts HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        chunk = b"a" * 65536
        sock.settimeout(0.05)
        for _ in range(4 * MAX_BODY_BYTES // len(chunk)):  # four times the cap at most
            try:
                sock.sendall(chunk)
                if answer := sock.recv(4096):
                    return answer
            except TimeoutError:
                continue
            except OSError:
                break
        sock.settimeout(2.0)
        return sock.recv(4096)
    finally:
        sock.close()


def _slow_head_closed_within(port: int, within_s: float) -> bool:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    try:
        sock.sendall(b"POST /alerts HTTP/1.1\r\nX-Slow: ")
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                sock.send(b"a")
            except OSError:
                return True
            sock.settimeout(0.1)
            try:
                if sock.recv(1) == b"":
                    return True
            except TimeoutError:
                continue
        return False
    finally:
        sock.close()


def test_a_body_without_end_is_refused_past_the_cap() -> None:
    async def attack() -> bytes:
        async with WebhookReceiver("secret-0123456789", limits=LIMITS) as receiver:
            return await asyncio.to_thread(_post_without_end, receiver.port)

    assert asyncio.run(attack()).startswith(b"HTTP/1.1 413")


def test_a_slow_head_is_cut_off_at_the_request_deadline() -> None:
    async def attack() -> bool:
        async with WebhookReceiver("secret-0123456789", limits=LIMITS) as receiver:
            within_s = LIMITS.request_deadline_s + 1.0
            return await asyncio.to_thread(_slow_head_closed_within, receiver.port, within_s)

    assert asyncio.run(attack())
