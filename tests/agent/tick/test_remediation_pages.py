"""Remediation's pages pass through the alert tracker: silences suppress them and the API
lists them, like any rule's alert."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvpilot.agent.app.parts import tick_settings
from kvpilot.agent.config import validate_config
from kvpilot.agent.model import AlertEvent
from kvpilot.agent.remediation.events import CIRCUIT_OPEN_ALERT, circuit_open_event, resolved
from kvpilot.agent.remediation.remediator import RemediationStatus
from kvpilot.agent.runtimes import AttachedServer, AttachRuntime
from kvpilot.agent.state import StateStore
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.agent.tick.watched import WatchedServers
from kvpilot.collectors.nvml import NvmlCollector


class PagingRemediator:
    """A test double of the part of the Remediator the sidecar calls: it restarts nothing
    and hands out the pages a test gives it."""

    def __init__(self) -> None:
        self.pages: list[AlertEvent] = []
        self.observed_rules: list[str] = []

    def take_events(self) -> list[AlertEvent]:
        pages, self.pages = self.pages, []
        return pages

    def observe(self, transitions, conditions, *, now_s):  # type: ignore[no-untyped-def]
        self.observed_rules.extend(t.rule for t in transitions)
        return []

    def reconcile(self) -> list[object]:
        return []

    def status(self) -> RemediationStatus:
        return RemediationStatus(
            dry_run=False, active=(), breakers=(), vetoed_instances=(), vetoed_incidents=()
        )

    def in_progress(self) -> bool:
        return False

    async def aclose(self) -> None:
        return None


def _sidecar(tmp_path: Path, store: StateStore, remediator: PagingRemediator) -> Sidecar:
    config = validate_config(
        {
            "state_dir": str(tmp_path),
            # Nothing listens there: delivery fails and the outbox keeps what was enqueued.
            "notifiers": [{"name": "hook", "kind": "webhook", "url": "http://127.0.0.1:9/x"}],
            "runtime": {
                "kind": "attach",
                "servers": [{"name": "vllm", "url": "http://127.0.0.1:9"}],
            },
        },
        warn=False,
    )
    runtime = AttachRuntime([AttachedServer(name="vllm", url="http://127.0.0.1:9")])
    return Sidecar(
        tick_settings(config),
        store=store,
        runtime=runtime,
        notifiers={},
        remediator=remediator,  # type: ignore[arg-type]
        watched=WatchedServers(tick_settings(config), NvmlCollector()),
    )


def _page(wall_s: float) -> AlertEvent:
    return circuit_open_event("vllm", "stable", 3, "not ready", incident_id="inc-1", wall_s=wall_s)


def test_a_page_is_an_alert_the_api_lists_and_the_outbox_carries(tmp_path: Path) -> None:
    async def scenario() -> None:
        with StateStore.open(tmp_path) as store:
            remediator = PagingRemediator()
            sidecar = _sidecar(tmp_path, store, remediator)
            remediator.pages.append(_page(sidecar.now_wall_s()))
            await sidecar.tick()
            firing = [a for a in sidecar.alerts.alerts() if a.rule == CIRCUIT_OPEN_ALERT]
            assert [a.state for a in firing] == ["firing"]
            queued = [i.event for i in store.outbox.pending()]
            assert [(dict(e.labels)["alertname"], e.status) for e in queued] == [
                (CIRCUIT_OPEN_ALERT, "firing")
            ]
            # The page is not a rule: the remediator is not asked to remediate it.
            assert CIRCUIT_OPEN_ALERT not in remediator.observed_rules
            # It holds on later ticks, then ends when the remediator resolves it.
            await sidecar.tick()
            assert [a.state for a in sidecar.alerts.alerts() if a.rule == CIRCUIT_OPEN_ALERT] == [
                "firing"
            ]
            remediator.pages.append(resolved(queued[0], sidecar.now_wall_s()))
            await sidecar.tick()
            assert [a.state for a in sidecar.alerts.alerts() if a.rule == CIRCUIT_OPEN_ALERT] == [
                "resolved"
            ]
            await sidecar.aclose()

    asyncio.run(scenario())


def test_a_silence_suppresses_a_page(tmp_path: Path) -> None:
    async def scenario() -> None:
        with StateStore.open(tmp_path) as store:
            remediator = PagingRemediator()
            sidecar = _sidecar(tmp_path, store, remediator)
            sidecar.alerts.tracker.silence(
                {"alertname": CIRCUIT_OPEN_ALERT}, sidecar.now_wall_s() + 600
            )
            remediator.pages.append(_page(sidecar.now_wall_s()))
            await sidecar.tick()
            assert [a.state for a in sidecar.alerts.alerts() if a.rule == CIRCUIT_OPEN_ALERT] == [
                "firing"
            ]
            alertnames = [dict(i.event.labels)["alertname"] for i in store.outbox.pending()]
            assert CIRCUIT_OPEN_ALERT not in alertnames
            await sidecar.aclose()

    asyncio.run(scenario())


def test_an_open_page_survives_a_restart_of_the_agent(tmp_path: Path) -> None:
    async def scenario() -> None:
        with StateStore.open(tmp_path) as store:
            remediator = PagingRemediator()
            sidecar = _sidecar(tmp_path, store, remediator)
            remediator.pages.append(_page(sidecar.now_wall_s()))
            await sidecar.tick()
            await sidecar.aclose()
        with StateStore.open(tmp_path) as store:
            again = _sidecar(tmp_path, store, PagingRemediator())
            for _ in range(3):
                await again.tick()
            states = [a.state for a in again.alerts.alerts() if a.rule == CIRCUIT_OPEN_ALERT]
            assert states == ["firing"]
            await again.aclose()

    asyncio.run(scenario())
