"""A full disk while an alert fires: no notification lost, no traceback, the agent ticks on.

The agent runs in this process through its real composition (`run_sidecar`: the store, the
tick, the HTTP server), against a recorded vLLM and a webhook receiver on loopback. The
disk fills for real as far as SQLite is concerned: the store's file is capped at its size
(`max_page_count`, what a full filesystem is to SQLite) and filled to the last byte, so
every write that needs a page fails with "database or disk is full". Freeing space lifts
the cap; the firing notification owed must then reach the receiver, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from kvpilot.agent.app.compose import run_sidecar
from kvpilot.agent.config import validate_config
from kvpilot.agent.state import StateStore
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.rig.server import free_port
from tests.agent.notify.notify_receiver import Receiver
from tests.agent.state.loopback import (
    SATURATION_ALERT,
    LoopbackVllm,
    agent_config,
    firing_notifications,
)

# Each test starts the agent as a process: the inner loop (-m "not slow") skips them.
pytestmark = pytest.mark.slow

T = TypeVar("T")
WRITE_LOG = "kvpilot.agent.state.write_failures"


async def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    """Poll `probe` on the event loop (the agent runs meanwhile) until it is truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def fill_to_the_last_byte(store: StateStore) -> None:
    """Caps the file at its size, then writes audit records, halving their size at each
    "full", until not even a small one fits: the audit table's pages are packed, so the
    alert's audit record (written first when it fires) needs a page there is no room for."""
    store.db.cap_pages(store.db.page_count())
    size = 3000
    while size >= 8:
        try:
            store.record_audit(
                wall_s=0.0,
                actor="agent",
                action="filler",
                target="disk",
                decision="filler",
                reason="x" * size,
            )
        except sqlite3.OperationalError as exc:
            assert "database or disk is full" in str(exc)
            size //= 2


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def _scrape(client: httpx.AsyncClient, url: str) -> tuple[int, str]:
    health = await client.get(f"{url}/healthz")
    metrics = await client.get(f"{url}/metrics")
    return health.status_code, metrics.text


async def _with_agent(
    tmp_path: Path,
    vllm: LoopbackVllm,
    receiver: Receiver,
    body: Callable[[Sidecar, str, httpx.AsyncClient], Awaitable[None]],
) -> None:
    port = free_port()
    data = agent_config(
        tmp_path / "state",
        vllm_url=vllm.url,
        receiver_url=receiver.url,
        listen_port=port,
        interval_s=0.2,
    )
    config = validate_config(data, {}, warn=False)
    stop = asyncio.Event()
    ticked: list[Sidecar] = []
    agent = asyncio.create_task(run_sidecar(config, stop=stop, on_tick=ticked.append))
    try:
        sidecar = await wait_for("the first tick", lambda: ticked[0] if ticked else None)
        async with httpx.AsyncClient(timeout=5.0) as client:
            await body(sidecar, f"http://127.0.0.1:{port}", client)
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(agent, timeout=30)


def test_a_notification_owed_during_a_full_disk_is_sent_once_when_space_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    async def scenario(sidecar: Sidecar, url: str, client: httpx.AsyncClient) -> None:
        store = sidecar.store
        fill_to_the_last_byte(store)
        outage_from = len(caplog.records)
        vllm.saturate()  # the alert fires while nothing can be written

        def failed_writes() -> int:
            return dict(sidecar.write_failures.totals()).get("disk_full", 0)

        await wait_for("a tick failing to write", lambda: failed_writes() >= 1)
        ticks = sidecar.ticks_total
        await wait_for("three more ticks", lambda: sidecar.ticks_total >= ticks + 3)
        assert firing_notifications(receiver, SATURATION_ALERT) == []
        # Memory agrees with the disk: neither holds the alert as firing (nor as sent), so
        # every tick tries again to write it.
        assert [a.state for a in store.load_alerts() if a.rule == "kv_saturation"] != ["firing"]
        assert "firing" not in [a.state for a in sidecar.alerts.alerts()]
        status, metrics = await _scrape(client, url)
        assert status == 200, "a tick that cannot write still completes: /healthz is fresh"
        counted = _metric(metrics, "kvpilot_state_write_errors_total", reason="disk_full")
        assert counted is not None and counted >= 3, metrics
        during = caplog.records[outage_from:]
        said = [r for r in during if r.name == WRITE_LOG and r.levelno == logging.ERROR]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert "database or disk is full" in said[0].getMessage()
        assert [r.getMessage() for r in during if r.exc_info] == [], "no traceback"

        store.db.cap_pages(None)  # space returns
        await wait_for(
            "the owed notification", lambda: firing_notifications(receiver, SATURATION_ALERT)
        )
        ticks = sidecar.ticks_total
        await wait_for("three more ticks", lambda: sidecar.ticks_total >= ticks + 3)
        assert len(firing_notifications(receiver, SATURATION_ALERT)) == 1
        saturation = [a.state for a in sidecar.alerts.alerts() if a.rule == "kv_saturation"]
        assert saturation == ["firing"]  # (the saturated stand-in trips other rules too)
        recovered = [
            r for r in caplog.records if r.name == WRITE_LOG and r.levelno == logging.WARNING
        ]
        assert len(recovered) == 1 and "succeed again" in recovered[0].getMessage()

    receiver = Receiver().start()
    try:
        with LoopbackVllm() as vllm:
            asyncio.run(_with_agent(tmp_path, vllm, receiver, scenario))
    finally:
        receiver.stop()
