"""`GET /api/v1/status` reads the runtime in a thread of its own: a runtime whose read hangs
(an API server that stopped answering) stalls that answer alone, never `/healthz` or the loop,
and the answer gives up after its deadline with a 503 instead of waiting for ever."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from kvpilot.agent.app.api import api_routes
from kvpilot.agent.app.control_ports import ControlPorts
from kvpilot.agent.app.exposition import build_registry
from kvpilot.agent.app.http import build_app
from kvpilot.agent.app.parts import tick_settings
from kvpilot.agent.remediation import Remediator
from kvpilot.agent.runtimes.attach import AttachedServer, AttachRuntime
from kvpilot.agent.runtimes.base import InstanceStatus
from kvpilot.agent.state import StateStore
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.agent.tick.watched import WatchedServers
from kvpilot.collectors.nvml import NvmlCollector
from tests.agent.quiet_sidecar import attach_config

pytestmark = pytest.mark.anyio

DEADLINE_S = 5.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class HangingRuntimeFake(AttachRuntime):
    """A fake: the attach runtime whose status read hangs until released, as a runtime's
    blocking read does when what it asks stops answering (no real part hangs on demand)."""

    def __init__(self, servers: list[AttachedServer]) -> None:
        super().__init__(servers)
        self.entered = threading.Event()
        self.release = threading.Event()

    def status(self, name: str) -> InstanceStatus:
        self.entered.set()
        self.release.wait(timeout=60)
        return super().status(name)


@dataclass
class Served:
    client: httpx.AsyncClient
    runtime: HangingRuntimeFake


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    config = attach_config(tmp_path)
    runtime = HangingRuntimeFake([AttachedServer(name="vllm", url="http://127.0.0.1:9")])
    with StateStore.open(config.state_dir) as store:
        remediator = Remediator(runtime, store, config.remediation)
        watched = WatchedServers(tick_settings(config), NvmlCollector(server_pids=frozenset))
        sidecar = Sidecar(
            tick_settings(config),
            store=store,
            runtime=runtime,
            remediator=remediator,
            notifiers={},
            watched=watched,
        )
        ports = ControlPorts(config, runtime, sidecar.alerts, remediator, sidecar)
        app = build_app(
            sidecar,
            build_registry(watched.servers, lambda out: None),
            clock=sidecar.clock,
            stale_after_s=10.0,
            extra_routes=api_routes(ports, SecretStr("t"), runtime_timeout_s=1.0),
        )
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://k") as client:
                yield Served(client, runtime)
        finally:
            runtime.release.set()
            await sidecar.aclose()


async def test_a_hung_runtime_read_does_not_stall_healthz(served: Served) -> None:
    status = asyncio.create_task(served.client.get("/api/v1/status"))
    entered = await asyncio.to_thread(served.runtime.entered.wait, DEADLINE_S)
    assert entered, "the status API never read the runtime"
    # The runtime's read hangs now; the loop still answers the health check at once.
    health = await asyncio.wait_for(served.client.get("/healthz"), DEADLINE_S)
    assert health.json()["ticks_total"] == 0
    assert not status.done()
    served.runtime.release.set()
    answer = await asyncio.wait_for(status, DEADLINE_S)
    assert answer.status_code == 200
    assert [t["name"] for t in answer.json()["targets"]] == ["vllm"]


async def test_a_runtime_read_past_its_deadline_answers_503(served: Served) -> None:
    answer = await asyncio.wait_for(served.client.get("/api/v1/status"), DEADLINE_S)
    assert answer.status_code == 503
    assert "did not answer within 1 s" in answer.json()["error"]
