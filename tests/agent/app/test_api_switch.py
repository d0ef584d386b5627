"""The control API's switch, vetoes and silences: listed without a token, changed with one,
over the real routes and a real Sidecar (test_api's fixture)."""

from __future__ import annotations

import pytest

from tests.agent.app import test_api
from tests.agent.app.test_api import AUTH, Api

# test_api's fixtures: its real Sidecar behind the real routes.
anyio_backend = test_api.anyio_backend
api = test_api.api

pytestmark = pytest.mark.anyio


async def test_the_mode_is_switched_and_cleared_through_the_api(api: Api) -> None:
    got = (await api.client.get("/api/v1/mode")).json()
    assert (got["mode"], got["source"]) == ("armed", "config")

    refused = await api.client.post("/api/v1/mode", json={"mode": "paused"})
    assert refused.status_code == 401
    assert api.sidecar.remediator.mode.current().mode == "armed"

    switched = await api.client.post("/api/v1/mode", json={"mode": "paused"}, headers=AUTH)
    assert switched.status_code == 200 and switched.json()["mode"] == "paused"
    assert switched.json()["source"] == "api"
    status = (await api.client.get("/api/v1/status")).json()["remediation"]
    assert (status["mode"], status["mode_source"]) == ("paused", "api")

    bad = await api.client.post("/api/v1/mode", json={"mode": "off"}, headers=AUTH)
    assert bad.status_code == 422
    cleared = await api.client.post("/api/v1/mode", json={"mode": None}, headers=AUTH)
    assert cleared.json()["mode"] == "armed" and cleared.json()["source"] == "config"


async def test_a_veto_with_a_duration_is_listed_and_lifted(api: Api) -> None:
    body = {"instance": "vllm", "reason": "maintenance", "duration_s": 3600}
    made = await api.client.post("/api/v1/vetoes", json=body, headers=AUTH)
    assert made.status_code == 201 and made.json()["veto"]["until_wall_s"] is not None

    listed = (await api.client.get("/api/v1/vetoes")).json()["vetoes"]
    assert [(v["kind"], v["target"], v["reason"]) for v in listed] == [
        ("instance", "vllm", "maintenance")
    ]
    assert (await api.client.delete("/api/v1/vetoes/instance/vllm")).status_code == 401
    lifted = await api.client.delete("/api/v1/vetoes/instance/vllm", headers=AUTH)
    assert lifted.status_code == 200 and lifted.json() == {"lifted": "vllm", "kind": "instance"}
    assert (await api.client.get("/api/v1/vetoes")).json()["vetoes"] == []
    again = await api.client.delete("/api/v1/vetoes/instance/vllm", headers=AUTH)
    assert again.status_code == 404
    wrong = await api.client.delete("/api/v1/vetoes/pod/vllm", headers=AUTH)
    assert wrong.status_code == 404


async def test_a_veto_longer_than_thirty_days_is_refused(api: Api) -> None:
    body = {"instance": "vllm", "reason": "r", "duration_s": 31 * 86400}
    refused = await api.client.post("/api/v1/vetoes", json=body, headers=AUTH)
    assert refused.status_code == 422
    assert (await api.client.get("/api/v1/vetoes")).json()["vetoes"] == []


async def test_silences_are_listed_and_expired(api: Api) -> None:
    body = {"matchers": {"alertname": "KvpilotKvCacheSaturated"}, "duration_s": 600}
    made = (await api.client.post("/api/v1/silences", json=body, headers=AUTH)).json()["silence"]
    listed = (await api.client.get("/api/v1/silences")).json()["silences"]
    assert [s["silence_id"] for s in listed] == [made["silence_id"]]
    assert listed[0]["matchers"] == {"alertname": "KvpilotKvCacheSaturated"}

    path = f"/api/v1/silences/{made['silence_id']}"
    assert (await api.client.delete(path)).status_code == 401
    expired = await api.client.delete(path, headers=AUTH)
    assert expired.status_code == 200
    assert (await api.client.get("/api/v1/silences")).json()["silences"] == []
    assert api.store.load_silences(0.0) == []  # saved: a restart does not bring it back
    assert (await api.client.delete(path, headers=AUTH)).status_code == 404
    audit = [r for r in api.store.audit_records() if r.action == "silence"]
    assert sorted(r.decision for r in audit) == ["created", "expired"]  # newest first
