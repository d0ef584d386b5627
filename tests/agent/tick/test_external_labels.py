"""What kvpilot notifies carries the replica's labels (namespace, pod, configured ones);
inside kvpilot the alert keeps its own, and `instance` stays the server's name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvpilot.agent.app.parts import tick_settings
from kvpilot.agent.config import ConfigError, validate_config
from kvpilot.agent.remediation.events import CIRCUIT_OPEN_ALERT, circuit_open_event
from kvpilot.agent.runtimes import AttachedServer, AttachRuntime
from kvpilot.agent.state import StateStore
from kvpilot.agent.tick.external_labels import replica_labels, with_external_labels
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.agent.tick.watched import WatchedServers
from kvpilot.collectors.nvml import NvmlCollector
from tests.agent.tick.test_remediation_pages import PagingRemediator


def _config(tmp_path: Path, external: dict[str, str]) -> dict:
    return {
        "state_dir": str(tmp_path),
        # Nothing listens there: delivery fails and the outbox keeps what was enqueued.
        "notifiers": [{"name": "hook", "kind": "webhook", "url": "http://127.0.0.1:9/x"}],
        "runtime": {"kind": "attach", "servers": [{"name": "vllm", "url": "http://127.0.0.1:9"}]},
        "rules": {"external_labels": external},
    }


def test_the_replica_is_named_by_the_pods_environment() -> None:
    environ = {"KVPILOT_POD_NAMESPACE": "serving", "KVPILOT_POD_NAME": "vllm-7d9f-x2", "X": "1"}
    assert replica_labels(environ) == {"namespace": "serving", "pod": "vllm-7d9f-x2"}
    assert replica_labels({"KVPILOT_POD_NAME": ""}) == {}  # one machine: no pod


def test_an_alert_keeps_its_own_labels_over_external_ones() -> None:
    page = circuit_open_event("vllm", "stable", 3, "not ready", incident_id="i", wall_s=1.0)
    sent = with_external_labels(page, {"instance": "elsewhere", "cluster": "eu-1"})
    assert dict(sent.labels)["instance"] == "vllm"
    assert dict(sent.labels)["cluster"] == "eu-1"
    assert sent.fingerprint == page.fingerprint  # receivers deduplicate on it as before
    assert with_external_labels(page, {}) is page


@pytest.mark.parametrize("name", ["instance", "alertname", "__name__", "a-b"])
def test_an_external_label_may_not_replace_an_alerts_own(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="external"):
        validate_config(_config(tmp_path, {name: "x"}), warn=False)


def test_notified_alerts_carry_namespace_pod_and_configured_labels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPILOT_POD_NAMESPACE", "serving")
    monkeypatch.setenv("KVPILOT_POD_NAME", "vllm-7d9f-x2")

    async def scenario() -> None:
        config = validate_config(_config(tmp_path, {"cluster": "eu-1"}), warn=False)
        with StateStore.open(tmp_path) as store:
            remediator = PagingRemediator()
            sidecar = Sidecar(
                tick_settings(config),
                store=store,
                runtime=AttachRuntime([AttachedServer(name="vllm", url="http://127.0.0.1:9")]),
                notifiers={},
                remediator=remediator,  # type: ignore[arg-type]
                watched=WatchedServers(tick_settings(config), NvmlCollector()),
            )
            page = circuit_open_event(
                "vllm", "stable", 3, "not ready", incident_id="i", wall_s=sidecar.now_wall_s()
            )
            remediator.pages.append(page)
            await sidecar.tick()
            (queued,) = [i.event for i in store.outbox.pending()]
            labels = dict(queued.labels)
            assert labels["alertname"] == CIRCUIT_OPEN_ALERT
            assert (labels["namespace"], labels["pod"], labels["cluster"]) == (
                "serving",
                "vllm-7d9f-x2",
                "eu-1",
            )
            assert labels["instance"] == "vllm"  # what remediation and silences target
            (tracked,) = [a for a in sidecar.alerts.alerts() if a.rule == CIRCUIT_OPEN_ALERT]
            assert "pod" not in dict(tracked.labels)  # kvpilot's own view is unchanged
            await sidecar.aclose()

    asyncio.run(scenario())
