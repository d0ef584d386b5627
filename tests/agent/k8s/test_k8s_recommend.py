"""Recommend-only promotion (a GitOps-owned Deployment): the patch is a file and an Event on
the Deployment, never a change to it; the status API shows it; a refused Event loses nothing.

The fake API server validates the Event against the core/v1 schema and the API server's own
Event rules; the stand-in vLLM answers the runtime's probes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client

from kvpilot.agent.app.api import api_routes
from kvpilot.agent.app.exposition import build_registry
from kvpilot.agent.app.http import build_app
from kvpilot.agent.app.parts import control_ports
from kvpilot.agent.config import AgentConfig
from kvpilot.agent.model import Action, AlertFacts
from kvpilot.agent.remediation import Remediator, Trigger
from kvpilot.agent.runtimes.kubernetes.recommend import EVENT_REASON
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from kvpilot.agent.state import StateStore
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime
from tests.agent.quiet_sidecar import quiet_sidecar
from tests.agent.remediation.remediation_helpers import remediation_config
from tests.fakes.k8s_apiserver import FakeKubernetesApi
from tests.fakes.remediation_journal import MemoryJournal

GITOPS = {"argocd.argoproj.io/instance": "serving"}
SECRET = "sk-recommend-0123456789"
EVENTS_PATH = f"/api/v1/namespaces/{NAMESPACE}/events"


def _args(port: int) -> list[str]:
    return [
        "--model=Qwen/Qwen2.5-1.5B-Instruct",
        "--host=0.0.0.0",
        f"--port={port}",
        f"--api-key={SECRET}",
        "--max-num-seqs=32",
    ]


def _promote(runtime: KubernetesRuntime, port: int) -> Any:
    return asyncio.run(runtime.promote(_args(port), ready_timeout_s=10))


def test_a_gitops_owned_deployment_gets_the_patch_as_a_file_and_an_event(
    fake: FakeKubernetesApi, standin: Any, tmp_path: Path
) -> None:
    stable = fake.add_deployment(base_deployment(standin.port, GITOPS))
    runtime = make_runtime(fake, standin.port, tmp_path)  # promote: auto

    promotion = _promote(runtime, standin.port)

    assert not promotion.applied
    rec = promotion.recommendation
    assert rec.path is not None and rec.path.exists() and SECRET not in rec.path.read_text()
    assert not fake.writes("PATCH")  # the Deployment was not touched
    assert [(r.method, r.path) for r in fake.writes()] == [("POST", EVENTS_PATH)]
    (event,) = fake.events.values()
    assert event["involvedObject"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "vllm",
        "namespace": NAMESPACE,
        "uid": stable["metadata"]["uid"],
        "resourceVersion": stable["metadata"]["resourceVersion"],
    }
    assert (event["type"], event["reason"]) == ("Normal", EVENT_REASON)
    assert str(rec.path) in event["message"] and rec.kubectl in event["message"]
    assert "GitOps" in event["message"] and SECRET not in event["message"]
    assert rec.event == f"Event {NAMESPACE}/{event['metadata']['name']} (reason {EVENT_REASON})"
    # `kubectl get events --field-selector involvedObject.name=vllm` finds it.
    core = client.CoreV1Api(fake.api_client())
    listed = core.list_namespaced_event(
        NAMESPACE, field_selector="involvedObject.kind=Deployment,involvedObject.name=vllm"
    )
    assert [e.reason for e in listed.items] == [EVENT_REASON]
    assert runtime.recommendations() == (rec,)


def test_a_refused_event_still_writes_the_file_and_says_what_is_missing(
    fake: FakeKubernetesApi, standin: Any, tmp_path: Path
) -> None:
    fake.add_deployment(base_deployment(standin.port))
    fake.forbid("create", "events")
    runtime = make_runtime(fake, standin.port, tmp_path, promote="recommend")

    rec = _promote(runtime, standin.port).recommendation

    assert rec.path.exists() and not fake.events and not fake.writes("PATCH")
    assert rec.event.startswith("no Event: forbidden")
    assert "may not 'create' events" in rec.event and "'kvpilot' grants it" in rec.event


def test_a_ladder_promotion_on_a_gitops_deployment_is_a_recommendation_not_a_failure(
    fake: FakeKubernetesApi, standin: Any, tmp_path: Path
) -> None:
    fake.add_deployment(base_deployment(standin.port, GITOPS))
    runtime = make_runtime(fake, standin.port, tmp_path)
    better = ("python3", "-m", "vllm.entrypoints.openai.api_server", *_args(standin.port))
    journal = MemoryJournal()
    remediator = Remediator(
        runtime,
        journal,
        remediation_config(cooldown_s=0.0, preflight={"enabled": False}),
        better_config=lambda name: better if name == "vllm" else None,
    )
    trigger = Trigger(
        "vllm",
        "preemption_spike",
        None,
        "inc-1",
        facts=AlertFacts(Action.LADDER, capacity_leak=False),
    )

    outcome = asyncio.run(remediator.remediate(trigger))

    assert outcome.decision == "skipped" and "recommend-only" in outcome.reason
    assert [a.decision for a in journal.audit if a.action == "promote"][-1] == "recommended"
    assert remediator.breaker.failures("vllm") == 0  # not a failed restart
    assert len(fake.events) == 1 and not fake.writes("PATCH")


def test_the_status_shows_the_latest_recommendation(
    fake: FakeKubernetesApi, standin: Any, tmp_path: Path
) -> None:
    fake.add_deployment(base_deployment(standin.port, GITOPS))
    runtime = make_runtime(fake, standin.port, tmp_path)
    rec = _promote(runtime, standin.port).recommendation
    config = AgentConfig.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {"kind": "attach", "servers": [{"name": "vllm", "url": "http://x:9"}]},
        }
    )
    config.state_dir.mkdir(parents=True)

    async def main() -> dict[str, Any]:
        with StateStore.open(config.state_dir) as store:
            sidecar = quiet_sidecar(config, store, runtime)
            app = build_app(
                sidecar,
                build_registry(sidecar.watched.servers, lambda out: None),
                clock=sidecar.clock,
                stale_after_s=10.0,
                extra_routes=api_routes(control_ports(config, sidecar), None),
            )
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://k") as api:
                answer = await api.get("/api/v1/status")
            await sidecar.aclose()
        assert answer.status_code == 200
        return answer.json()

    body = asyncio.run(main())
    (shown,) = body["recommendations"]
    assert shown == {
        "deployment": "vllm",
        "namespace": NAMESPACE,
        "path": str(rec.path),
        "reason": rec.reason,
        "kubectl": rec.kubectl,
        "event": rec.event,
        "wall_s": rec.wall_s,
    }
    assert "GitOps" in shown["reason"] and shown["event"].startswith("Event ")
