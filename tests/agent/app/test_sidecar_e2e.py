"""The sidecar end to end: a real CPU vLLM under the `local` runtime, a real webhook receiver
and a real Alertmanager, `kvpilot run --config` as a real process.

One agent and one server serve the whole module, in order: a preemption spike fires, is
notified (signed, version 4) and pushed to Alertmanager, the server is drained and
restarted, the alert resolves once the load stops; the control API refuses requests
without the token; a server killed outright is detected and restarted once while the
receiver is down; then kvpilot itself is killed with SIGKILL and started again: the
notifications it owed arrive, and the incident is not restarted a second time.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpilot.rig.server import free_port
from tests.agent.notify.alertmanager_server import AlertmanagerServer, find_binary
from tests.agent.notify.notify_receiver import Received, Receiver
from tests.agent.sidecar_harness import (
    AgentProcess,
    agent_config,
    burst_in_background,
    control,
    kill_servers_of,
    server_spec,
    wait_for,
)

pytestmark = pytest.mark.slow

SECRET = "e2e-webhook-secret"
# 64 blocks of 32 tokens (63 usable): 48 requests of ~300 tokens at once preempt heavily.
PREEMPTING_KV_BYTES = 64 * 32 * 1024


@dataclass
class Rig:
    agent: AgentProcess
    receiver: Receiver
    alertmanager: AlertmanagerServer
    vllm_url: str
    marker: str


def _payloads(receiver: Receiver, alertname: str, status: str) -> list[tuple[Received, Any]]:
    found = []
    for request in receiver.accepted():
        body = request.json()
        for alert in body.get("alerts", []):
            if alert["labels"].get("alertname") == alertname and alert["status"] == status:
                found.append((request, body))
    return found


def _restarts(agent: AgentProcess) -> list[dict[str, Any]]:
    return [r for r in agent.status()["last_actions"] if r["action"] in ("restart", "promote")]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    binary = find_binary()
    assert binary, "prometheus-alertmanager is not installed: ./scripts/setup installs it"
    tmp = Path(tmp_path_factory.mktemp("sidecar"))
    alertmanager = AlertmanagerServer(binary, tmp / "am")
    (tmp / "am").mkdir()
    alertmanager.start()
    receiver = Receiver(secret=SECRET).start()
    marker = f"e2e-{os.getpid()}-{free_port()}"
    spec = server_spec(
        kv_cache_memory_bytes=PREEMPTING_KV_BYTES, served_model_name=marker, shutdown_timeout_s=5
    )
    listen_port = free_port()
    config = agent_config(
        tmp,
        spec=spec,
        listen_port=listen_port,
        rules={
            "preemption_spike": {
                "action": "restart",
                "for_s": 0,
                "window_s": 10,
                "baseline_window_s": 60,
                "floor_per_s": 0.2,
                "baseline_multiple": 2,
            },
            "server_down": {"for_s": 2},
            "fragmentation": {"kv_blocks": {"enabled": False}},
            "kv_saturation": {"enabled": False},
            "engine_stall": {"enabled": False},
        },
        notifiers=[
            {"kind": "webhook", "url": f"{receiver.url}/hook", "hmac_secret": SECRET},
            {"kind": "alertmanager", "url": alertmanager.url, "repeat_interval_s": 30},
        ],
        remediation={
            "cooldown_s": 0,
            "drain_timeout_s": 10,
            "verify_timeout_s": 300,
            "budget": {"max_restarts": 5, "window_s": 3600},
            "circuit_breaker": {"failures_to_open": 3, "hold_s": 20},
        },
    )
    agent = AgentProcess(config, listen_port, tmp / "agent.log").start()
    try:
        wait_for(
            "vLLM started by the agent",
            lambda: agent.started("vllm") and agent.collector_up("vllm"),
            360,
        )
        yield Rig(agent, receiver, alertmanager, spec.url, marker)
    finally:
        agent.stop()
        kill_servers_of(marker)
        receiver.stop()
        alertmanager.stop()


def test_preemption_spike_is_notified_remediated_and_resolved(rig: Rig) -> None:
    agent, receiver = rig.agent, rig.receiver
    first_pid = agent.main_pid()
    assert first_pid is not None
    load, reports = burst_in_background(rig.vllm_url, rig.marker)

    firing = wait_for(
        "a signed VllmPreemptionSpike notification",
        lambda: _payloads(receiver, "VllmPreemptionSpike", "firing"),
        240,
    )
    request, body = firing[0]
    assert request.signature_ok is True
    assert body["version"] == "4" and body["status"] == "firing"
    alert = next(a for a in body["alerts"] if a["labels"]["alertname"] == "VllmPreemptionSpike")
    assert alert["labels"]["instance"] == "vllm" and alert["fingerprint"]
    assert alert["annotations"]["kvpilot_incident_id"]
    assert request.headers["x-kvpilot-dedup-key"].startswith(alert["fingerprint"])

    in_alertmanager = wait_for(
        "the alert in Alertmanager's own API",
        lambda: [
            a
            for a in rig.alertmanager.alerts()
            if a["labels"].get("alertname") == "VllmPreemptionSpike"
        ],
        60,
    )
    assert in_alertmanager[0]["labels"]["instance"] == "vllm"

    # action: restart: drained, restarted (a new PID), verified with a probe.
    restarted = wait_for(
        "a restart that succeeded",
        lambda: [r for r in _restarts(agent) if r["state"] == "succeeded"],
        400,
    )
    assert restarted[0]["old_pid"] == first_pid
    new_pid = agent.main_pid()
    assert new_pid is not None and new_pid != first_pid
    assert not Path(f"/proc/{first_pid}").exists() or _is_zombie(first_pid)
    answer = httpx.post(
        f"{rig.vllm_url}/v1/completions",
        json={"model": rig.marker, "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True},
        timeout=60,
    )
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3

    load.join(timeout=300)
    assert not load.is_alive()
    assert reports and len(reports[0].ok) > 0  # the load really reached the server
    resolved = wait_for(
        "the resolved notification once the load stopped",
        lambda: _payloads(receiver, "VllmPreemptionSpike", "resolved"),
        180,
    )
    fired_alert = alert
    resolved_alert = next(
        a for a in resolved[0][1]["alerts"] if a["labels"]["alertname"] == "VllmPreemptionSpike"
    )
    assert resolved_alert["fingerprint"] == fired_alert["fingerprint"]
    assert resolved_alert["startsAt"] == fired_alert["startsAt"]


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True


def test_control_api_refuses_requests_without_the_token(rig: Rig) -> None:
    body = {"matchers": {"alertname": "VllmKvCacheSaturated"}, "duration_s": 60}
    assert control(rig.agent, "/api/v1/silences", body, token=None).status_code == 401
    assert control(rig.agent, "/api/v1/silences", body, token="wrong").status_code == 401
    assert control(rig.agent, "/api/v1/remediations", {"instance": "vllm"}, None).status_code == 401
    made = control(rig.agent, "/api/v1/silences", body)
    assert made.status_code == 201, made.text
    assert made.json()["silence"]["matchers"] == {"alertname": "VllmKvCacheSaturated"}


def test_a_killed_server_is_detected_and_restarted_once(rig: Rig) -> None:
    agent, receiver = rig.agent, rig.receiver
    receiver.answer(503)  # the receiver is down from now on
    before = len(_restarts(agent))
    victim = agent.main_pid()
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    wait_for(
        "VllmServerDown firing",
        lambda: [
            a
            for a in agent.status()["alerts"]
            if dict(a["labels"])["alertname"] == "VllmServerDown" and a["state"] == "firing"
        ],
        60,
    )
    wait_for(
        "the server back under a new PID",
        lambda: (
            agent.target()["state"] == "running"
            and agent.main_pid() not in (None, victim)
            and len([r for r in _restarts(agent) if r["state"] == "succeeded"]) > before
        ),
        400,
    )
    # The notifications could not be delivered: they wait in the outbox.
    assert agent.status()["outbox_backlog"] > 0
    assert not _payloads(receiver, "VllmServerDown", "firing")


def test_kvpilot_killed_and_started_again_delivers_what_it_owed(rig: Rig) -> None:
    agent, receiver = rig.agent, rig.receiver
    serving_pid = agent.main_pid()
    restarts_before = len(_restarts(agent))
    agent.kill()  # SIGKILL: no shutdown path runs
    receiver.answer(200)
    agent.start()
    # The server kvpilot started before is adopted, not started twice on its port.
    wait_for("the target adopted", lambda: agent.main_pid() == serving_pid, 60)
    fired = wait_for(
        "the owed VllmServerDown notification",
        lambda: _payloads(receiver, "VllmServerDown", "firing"),
        120,
    )
    # Duplicates, if any, carry the same de-duplication key.
    keys = {request.headers["x-kvpilot-dedup-key"] for request, _ in fired}
    assert len(keys) == 1
    wait_for("the outbox drained", lambda: agent.status()["outbox_backlog"] == 0, 120)
    # No second restart for the same incident: a few more ticks, same PID, same history.
    ticks = agent.status()["ticks_total"]
    wait_for("ten more ticks", lambda: agent.status()["ticks_total"] >= ticks + 10, 60)
    assert agent.main_pid() == serving_pid
    assert len(_restarts(agent)) == restarts_before
    assert any(
        entry.get("message", "").startswith("instance vllm: adopted") for entry in agent.logs()
    )
