"""The loop's edges: the listen address bound before anything runs, signals owned from the
start (SIGTERM stops, SIGHUP reloads or is answered)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

import pytest
from starlette.applications import Starlette

from kvpilot.agent.app.lifecycle import (
    NO_RELOAD,
    SIGHUP_WHILE_STARTING,
    ListenError,
    LoopSettings,
    bind_listener,
    own_signals,
    serve_and_tick,
)


def _taken() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_taken_port_raises_before_anything_runs(caplog: pytest.LogCaptureFixture) -> None:
    ticks: list[int] = []

    async def tick() -> None:
        ticks.append(1)

    with _taken() as taken:
        port = taken.getsockname()[1]
        settings = LoopSettings(listen_port=port, interval_s=0.1)
        with caplog.at_level(logging.INFO), pytest.raises(ListenError) as info:
            asyncio.run(serve_and_tick(tick, Starlette(), settings))
    assert str(info.value) == (
        f"cannot listen on 127.0.0.1:{port}: address already in use (another process listens there)"
    )
    assert ticks == [] and caplog.records == []  # nothing ran, nothing claimed to listen


def test_an_address_that_is_not_this_machines_is_said_plainly() -> None:
    with pytest.raises(ListenError, match="not an address of this machine"):
        bind_listener("192.0.2.1", 0)  # TEST-NET-1: never a local address


def _run_with_sighups(reload, sighups: int, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        stop = asyncio.Event()
        ticked = asyncio.Event()

        async def tick() -> None:
            ticked.set()

        settings = LoopSettings(listen_port=0, interval_s=0.05, shutdown_grace_s=2.0)
        loop = asyncio.create_task(
            serve_and_tick(tick, Starlette(), settings, stop=stop, reload=reload)
        )
        await asyncio.wait_for(ticked.wait(), 10)
        for _ in range(sighups):
            os.kill(os.getpid(), signal.SIGHUP)
            await asyncio.sleep(0.1)
        assert not loop.done()  # still serving
        stop.set()
        await asyncio.wait_for(loop, 10)

    with caplog.at_level(logging.INFO):
        asyncio.run(main())


def test_sighup_without_a_reload_is_survived_and_said(caplog: pytest.LogCaptureFixture) -> None:
    _run_with_sighups(None, 1, caplog)
    assert f"received SIGHUP: {NO_RELOAD}" in caplog.messages


def test_sighup_reloads_one_at_a_time(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    async def reload() -> None:
        calls.append(1)
        await asyncio.sleep(0.5)  # still running at the second SIGHUP

    _run_with_sighups(reload, 2, caplog)
    assert calls == [1]
    assert "received SIGHUP: a reload is still running; this one is skipped" in caplog.messages


def test_a_reload_that_raises_keeps_the_agent_running(caplog: pytest.LogCaptureFixture) -> None:
    async def reload() -> None:
        raise RuntimeError("bug")

    _run_with_sighups(reload, 1, caplog)
    assert "reload failed; still running the configuration loaded before" in caplog.messages


def test_signals_before_serving_are_answered_and_sigterm_sets_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> bool:
        stop = asyncio.Event()
        own_signals(stop)  # what `kvpilot run` does first, before it adopts or starts anything
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0.1)  # the loop reads the signal
        assert not stop.is_set()  # a SIGHUP while starting never stops it
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 10)
        return stop.is_set()

    with caplog.at_level(logging.INFO):
        assert asyncio.run(main())
    assert SIGHUP_WHILE_STARTING in caplog.messages
    assert "received SIGTERM, shutting down" in caplog.messages
