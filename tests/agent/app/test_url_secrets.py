"""A scrape URL's password and query token, once its server fails, reach neither the API
(which needs no token to read), nor the stored outbox every receiver is sent from, nor the
stored alerts, nor `kvpilot config check`. One real tick over a real Sidecar (SQLite store,
attach runtime) whose server refuses, read through the real `api_routes`."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from kvpilot.agent.app.api import api_routes
from kvpilot.agent.app.exposition import build_registry
from kvpilot.agent.app.http import build_app
from kvpilot.agent.app.parts import build_runtime, control_ports
from kvpilot.agent.cli.config_cmd import summary
from kvpilot.agent.config import AgentConfig
from kvpilot.agent.model import AlertEvent, Condition, labels_of
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.db import DB_FILENAME
from kvpilot.agent.state.outbox import event_to_json
from kvpilot.agent.tick.sidecar import Sidecar
from tests.agent.quiet_sidecar import quiet_sidecar

PASSWORD = "hunter2-pw"
TOKEN = "q-t0ken-77"
# Port 9 (discard) refuses on loopback: the source fails and its message names the URL.
SERVER_URL = f"http://scraper:{PASSWORD}@127.0.0.1:9"
LEAKED_URL = f"http://scraper:{PASSWORD}@127.0.0.1:9/metrics?token={TOKEN}"

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _config(tmp_path: Path) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {"kind": "attach", "servers": [{"name": "vllm", "url": SERVER_URL}]},
            "notifiers": [
                {"name": "hook", "kind": "webhook", "url": f"http://127.0.0.1:9/?token={TOKEN}"}
            ],
        }
    )


class Agent:
    def __init__(self, client: httpx.AsyncClient, sidecar: Sidecar, state_dir: Path) -> None:
        self.client = client
        self.sidecar = sidecar
        self.state_dir = state_dir


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    config = _config(tmp_path)
    config.state_dir.mkdir(parents=True)
    with StateStore.open(config.state_dir) as store:
        runtime = build_runtime(config)
        sidecar = quiet_sidecar(config, store, runtime)
        app = build_app(
            sidecar,
            build_registry(sidecar.watched.servers, lambda out: None),
            clock=sidecar.clock,
            stale_after_s=10.0,
            extra_routes=api_routes(control_ports(config, sidecar), None),
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvpilot") as client:
            yield Agent(client, sidecar, config.state_dir)
        await sidecar.aclose()


def _assert_clean(text: str) -> None:
    assert PASSWORD not in text and TOKEN not in text, text[:2000]


async def test_a_failed_scrape_names_its_url_masked_in_the_api_and_the_state(agent: Agent) -> None:
    await agent.sidecar.tick()
    alerts = (await agent.client.get("/api/v1/alerts")).json()["alerts"]
    reasons = [a["reason"] for a in alerts if a["reason"]]
    assert any("127.0.0.1:9" in r for r in reasons), alerts  # the URL is there, masked
    for path in ("/api/v1/alerts", "/api/v1/status"):
        response = await agent.client.get(path)
        assert response.status_code == 200
        _assert_clean(response.text)
    agent.sidecar.store.save_alerts(agent.sidecar.alerts.tracker.to_rows())
    with sqlite3.connect(agent.state_dir / DB_FILENAME) as db:
        _assert_clean(repr(db.execute("SELECT * FROM alerts").fetchall()))


async def test_the_api_masks_a_url_whatever_wrote_it(agent: Agent) -> None:
    labels = labels_of({"alertname": "X", "instance": "vllm", "role": "stable"})
    reason = f"kvpool source down (refused): cannot connect to {LEAKED_URL}"
    condition = Condition(
        "x",
        labels,
        active=None,
        value=None,
        summary="x",
        reason=reason,
        annotations=labels_of({"unknown_reason": reason}),
    )
    agent.sidecar.alerts.tracker.update([condition], now_s=100.0, now_wall_s=1e9)
    for path in ("/api/v1/alerts", "/api/v1/status"):
        response = await agent.client.get(path)
        assert response.status_code == 200 and "cannot connect to http://" in response.text
        _assert_clean(response.text)


def test_an_event_is_stored_for_receivers_with_its_urls_masked() -> None:
    event = AlertEvent(
        fingerprint="f",
        incident_id="i",
        status="firing",
        labels=labels_of({"alertname": "X"}),
        annotations=labels_of({"description": f"vllm source down (refused): {LEAKED_URL}"}),
        starts_at_wall_s=1e9,
        ends_at_wall_s=None,
        generator_url="http://kvpilot/",
    )
    stored = event_to_json(event)
    assert "127.0.0.1:9" in stored
    _assert_clean(stored)


def test_config_check_shows_every_url_masked(tmp_path: Path) -> None:
    lines = "\n".join(summary(_config(tmp_path)))
    assert "vllm (stable) http://***@127.0.0.1:9" in lines
    _assert_clean(lines)
