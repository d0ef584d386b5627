"""The JSON API in process: the real `api_routes` over a real Sidecar (SQLite store, attach
runtime, remediator), served by the real `build_app` through httpx's ASGI transport."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from kvpilot.agent.app.api import api_routes
from kvpilot.agent.app.exposition import build_registry
from kvpilot.agent.app.http import build_app
from kvpilot.agent.app.parts import build_runtime, control_ports
from kvpilot.agent.app.request_body import BodyLimits
from kvpilot.agent.model import Condition, labels_of
from kvpilot.agent.state import StateStore
from kvpilot.agent.tick.sidecar import Sidecar
from tests.agent.quiet_sidecar import attach_config, quiet_sidecar

TOKEN = "in-process-token-51ab"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Api:
    def __init__(self, client: httpx.AsyncClient, sidecar: Sidecar, store: StateStore) -> None:
        self.client = client
        self.sidecar = sidecar
        self.store = store


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    config = attach_config(tmp_path)
    with StateStore.open(config.state_dir) as store:
        runtime = build_runtime(config)
        sidecar = quiet_sidecar(config, store, runtime)
        routes = api_routes(
            control_ports(config, sidecar),
            SecretStr(TOKEN),
            BodyLimits(max_bytes=1024, max_depth=4),
        )
        app = build_app(
            sidecar,
            build_registry(sidecar.watched.servers, lambda out: None),
            clock=sidecar.clock,
            stale_after_s=10.0,
            extra_routes=routes,
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvpilot") as client:
            yield Api(client, sidecar, store)
        await sidecar.aclose()


def _strict(text: str) -> Any:
    def refuse(token: str) -> None:
        raise AssertionError(f"not JSON: {token} in {text[:200]}")

    return json.loads(text, parse_constant=refuse)


def _api_audit(api: Api) -> list[Any]:
    return [r for r in api.store.audit_records() if r.actor == "api"]


def _condition(rule: str, instance: str, value: float) -> Condition:
    labels = labels_of({"alertname": rule, "instance": instance, "role": "stable"})
    return Condition(rule, labels, active=True, value=value, summary=f"{rule} at {value}")


async def test_non_finite_alert_values_are_null_in_status_and_alerts(api: Api) -> None:
    values = {"nan": math.nan, "inf": math.inf, "minus_inf": -math.inf, "finite": 0.5}
    api.sidecar.alerts.tracker.update(
        [_condition(rule, "vllm", value) for rule, value in values.items()],
        now_s=100.0,
        now_wall_s=1e9,
    )
    for path in ("/api/v1/alerts", "/api/v1/status"):
        response = await api.client.get(path)
        assert response.status_code == 200, response.text[:300]
        shown = {a["rule"]: a["value"] for a in _strict(response.text)["alerts"]}
        assert shown == {"nan": None, "inf": None, "minus_inf": None, "finite": 0.5}


async def test_an_unexpected_error_is_a_short_json_500_logged_once(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    api.store.close()  # the state file is gone from under the handler
    with caplog.at_level(logging.ERROR):
        response = await api.client.get("/api/v1/status")
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and len(body["error"]) < 100
    assert "Traceback" not in response.text and "sqlite" not in response.text.lower()
    failures = [r for r in caplog.records if r.exc_info is not None]
    assert len(failures) == 1, [r.getMessage() for r in caplog.records]
    assert failures[0].getMessage() == "GET /api/v1/status failed"


async def test_the_token_is_checked_before_the_limits(api: Api) -> None:
    response = await api.client.post("/api/v1/silences", content=b"[" * 5000)
    assert response.status_code == 401
    response = await api.client.post("/api/v1/silences", content=b"[" * 5000, headers=AUTH)
    assert response.status_code == 413


async def test_limits_are_the_ones_given(api: Api) -> None:
    deep = b'{"matchers": {"a": "b"}, "duration_s": 60, "x": [[[[1]]]]}'
    response = await api.client.post("/api/v1/silences", content=deep, headers=AUTH)
    assert response.status_code == 400 and "nested deeper than 4" in response.json()["error"]

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"matchers": {"a": "'
        yield b"b" * 2000
        yield b'"}, "duration_s": 60}'

    response = await api.client.post("/api/v1/silences", content=chunks(), headers=AUTH)
    assert response.status_code == 413 and "over 1024 bytes" in response.json()["error"]
    assert api.sidecar.alerts.tracker.silences() == []
    assert _api_audit(api) == []


async def test_a_silence_within_the_limits_is_made_and_audited(api: Api) -> None:
    body = {"matchers": {"alertname": "KvSaturation"}, "duration_s": 60, "comment": "deploy"}
    response = await api.client.post("/api/v1/silences", json=body, headers=AUTH)
    assert response.status_code == 201, response.text
    assert response.json()["silence"]["matchers"] == {"alertname": "KvSaturation"}
    assert len(api.sidecar.alerts.tracker.silences()) == 1
    assert [(r.action, r.decision) for r in _api_audit(api)] == [("silence", "created")]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/vetoes", {"instance": "gone", "reason": "typo"}),
        ("/api/v1/breakers/gone/reset", None),
        ("/api/v1/remediations", {"instance": "gone"}),
    ],
)
async def test_an_unknown_instance_is_not_found_and_nothing_is_recorded(
    api: Api, path: str, body: dict[str, str] | None
) -> None:
    response = await api.client.post(path, json=body, headers=AUTH)
    assert response.status_code == 404
    assert response.json() == {"error": "unknown instance 'gone'"}
    assert _api_audit(api) == []
    assert api.store.get_fact("remediation.vetoes") is None
    assert api.store.get_fact("remediation.breaker.gone") is None
    assert api.sidecar.remediator.status().vetoed_instances == ()


async def test_a_known_instance_is_vetoed_and_its_breaker_reset(api: Api) -> None:
    vetoed = await api.client.post(
        "/api/v1/vetoes", json={"instance": "vllm", "reason": "maintenance"}, headers=AUTH
    )
    assert vetoed.status_code == 201, vetoed.text
    reset = await api.client.post("/api/v1/breakers/vllm/reset", headers=AUTH)
    assert reset.status_code == 200 and reset.json() == {"instance": "vllm", "was_open": False}
    assert api.sidecar.remediator.status().vetoed_instances == ("vllm",)
    assert [r.action for r in _api_audit(api)] == ["circuit_breaker", "veto"]  # newest first


async def test_starlettes_own_refusals_are_json_too(api: Api) -> None:
    response = await api.client.get("/api/v1/breakers/vllm-0/reset")
    assert response.status_code == 405 and response.json() == {"error": "Method Not Allowed"}
    assert "POST" in response.headers["allow"]
    response = await api.client.get("/api/v1/nothing-here")
    assert response.status_code == 404 and response.json() == {"error": "Not Found"}
