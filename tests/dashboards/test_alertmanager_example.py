"""The Alertmanager example: amtool accepts it, every kvpilot alert reaches its team, and on a
real Alertmanager one condition raised on both paths notifies once."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from exported_series import VLLM_PAYLOAD, Series, agent_exposition, pick, scraped
from prometheus_server import wait_for

from kvpilot.agent.model import AlertEvent, labels_of
from kvpilot.agent.remediation.events import CIRCUIT_OPEN_ALERT, circuit_open_event
from kvpilot.agent.remediation.oom.guard import SERVER_OOM_ALERT
from kvpilot.agent.rules import gpu_memory, server_down
from kvpilot.agent.rules.config import PreemptionSpikeConfig, RulesConfig, ServerDownConfig
from kvpilot.agent.rules.preemption import PreemptionSpikeRule
from kvpilot.agent.rules.server_down import ServerDownRule
from kvpilot.agent.tick.external_labels import replica_labels, with_external_labels
from kvpilot.collectors.vllm_metrics import parse_vllm_metrics
from kvpilot.dashboards.rules import build_rules
from kvpilot.rig.server import free_port
from tests.agent.rules.rules_helpers import Driver

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "alertmanager.yml"
AMTOOL = "/usr/bin/amtool"
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
# Alerts the sidecar raises beside its rules' (pushed); the circuit breaker's on both paths.
SIDECAR_RAISED = {
    server_down.ALERTNAME,
    gpu_memory.PRESSURE_ALERTNAME,
    SERVER_OOM_ALERT,
    CIRCUIT_OPEN_ALERT,
    "KvpilotTuningRecommended",
}
NAMESPACE = "serving"


def _amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AMTOOL, *args], capture_output=True, text=True, timeout=60, check=False)


def test_amtool_accepts_the_example() -> None:
    result = _amtool("check-config", str(EXAMPLE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def _rule_alerts() -> dict[str, str]:
    groups = yaml.safe_load(build_rules(RulesConfig()).rules_file())["groups"]
    return {
        rule["alert"]: rule["labels"]["severity"]
        for group in groups
        for rule in group["rules"]
        if "alert" in rule
    }


@pytest.mark.parametrize("severity", ["warning", "critical"])
def test_every_kvpilot_alert_reaches_a_team(severity: str) -> None:
    teams = {"model-owners", "platform"}
    for name in sorted(set(_rule_alerts()) | SIDECAR_RAISED):
        result = _amtool(
            "config",
            "routes",
            "test",
            f"--config.file={EXAMPLE}",
            f"alertname={name}",
            f"severity={severity}",
        )
        receiver = result.stdout.strip()
        assert result.returncode == 0, result.stderr
        team = receiver.removesuffix("-pager")
        assert team in teams, (name, receiver)
        assert receiver.endswith("-pager") == (severity == "critical"), (name, receiver)
    own = {name for name in _rule_alerts() if name.startswith("Kvpilot")} - SIDECAR_RAISED
    for name in own:
        result = _amtool(
            "config", "routes", "test", f"--config.file={EXAMPLE}", f"alertname={name}"
        )
        assert result.stdout.strip() == "platform", name


class _Alertmanager:
    """Debian's Alertmanager on a loopback port, on the example with a one-second group_wait."""

    def __init__(self, folder: Path) -> None:
        config = yaml.safe_load(EXAMPLE.read_text())
        config["route"]["group_wait"] = "1s"  # the routing and inhibitions stay as shipped
        (folder / "alertmanager.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = folder / "alertmanager.log"
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    ALERTMANAGER,
                    f"--config.file={folder / 'alertmanager.yml'}",
                    f"--storage.path={folder / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                    "--cluster.listen-address=",  # one instance, no gossip port
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(self._ready, 30, lambda: f"Alertmanager not ready:\n{self.log.read_text()}")

    def _ready(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def post(self, alerts: list[Mapping[str, str]]) -> None:
        body = [{"labels": dict(labels)} for labels in alerts]
        response = httpx.post(f"{self.url}/api/v2/alerts", json=body, timeout=10)
        assert response.status_code == 200, response.text

    def alerts(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/api/v2/alerts", timeout=10).json()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[_Alertmanager]:
    server = _Alertmanager(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def _pushed(labels: tuple[tuple[str, str], ...], pod: str) -> dict[str, str]:
    """An alert as the sidecar in `pod` notifies it (its replica's labels added on the way)."""
    event = AlertEvent("f", "i", "firing", labels, (), 0.0, None, "")
    env = {"KVPILOT_POD_NAMESPACE": NAMESPACE, "KVPILOT_POD_NAME": pod}
    return dict(with_external_labels(event, replica_labels(env)).labels)


def _evaluated(labels: Mapping[str, str], alertname: str, severity: str) -> dict[str, str]:
    """An alert as Prometheus raises it on a series: its labels, the name and severity."""
    return {**labels, "alertname": alertname, "severity": severity}


def _scraped_by_the_operator(text: str, job: str, pod: str) -> tuple[Series, ...]:
    """Series as prometheus-operator's ServiceMonitor scrapes them: with namespace and pod."""
    target = {"job": job, "instance": "10.1.2.3:8000", "namespace": NAMESPACE, "pod": pod}
    return scraped(text, target)


def _key(labels: Mapping[str, str]) -> str:
    return str(labels_of(labels))


def test_one_condition_on_both_paths_notifies_once(alertmanager: _Alertmanager) -> None:
    engines = parse_vllm_metrics(VLLM_PAYLOAD.read_text(), taken_at_s=1.0, wall_time_s=1e9)
    # The sidecar's own conditions, from its rules on the recorded vLLM figures.
    spike = Driver(PreemptionSpikeRule(PreemptionSpikeConfig())).tick(1.0, engines=engines)[0]
    down = Driver(ServerDownRule(ServerDownConfig())).tick(
        1.0, engines=engines, instance_state="exited"
    )[0]
    page = circuit_open_event("vllm", "stable", 3, "not ready", incident_id="i", wall_s=1.0)
    # Prometheus's copies, on the series kvpilot and vLLM export.
    agent = _scraped_by_the_operator(agent_exposition(), "kvpilot", "vllm-a")
    vllm = _scraped_by_the_operator(VLLM_PAYLOAD.read_text(), "vllm", "vllm-c")
    counter = pick(agent, "kvpilot_preemptions_total", counter="kvpool").alert_labels()
    rate = {k: v for k, v in counter.items() if k != "counter"}  # the recording rule's `max`
    both_a = _evaluated(rate, "VllmPreemptionSpike", "warning")
    pushed_a = _pushed(spike.labels, "vllm-a")
    pushed_b = _pushed(spike.labels, "vllm-b")  # no Prometheus copy: it must pass
    circuit = _evaluated(
        pick(agent, "kvpilot_remediation_circuit_open").alert_labels(),
        CIRCUIT_OPEN_ALERT,
        "critical",
    )
    pushed_page = _pushed(page.labels, "vllm-a")
    down_c = _pushed(down.labels, "vllm-c")
    stalled_c = _evaluated(
        pick(vllm, "vllm:num_requests_running").alert_labels(), "VllmEngineStalled", "critical"
    )
    alertmanager.post([both_a, pushed_a, pushed_b, circuit, pushed_page, down_c, stalled_c])

    def inhibited() -> set[str] | None:
        states = {str(labels_of(a["labels"])): a["status"] for a in alertmanager.alerts()}
        if any(s["state"] == "unprocessed" for s in states.values()) or len(states) < 7:
            return None
        return {k for k, s in states.items() if s["inhibitedBy"]}

    got = wait_for(inhibited, 30, lambda: f"alerts never processed: {alertmanager.alerts()}")
    # The sidecar's copies of what Prometheus raises too, and what the down server causes.
    assert got == {_key(pushed_a), _key(pushed_page), _key(stalled_c)}
