"""What a replica keeps with its Deployment beyond its pod: the operators' vetoes and the
learned workload, in the ConfigMap `<deployment>-kvpilot-guards`, against the fake API server
(tests/fakes/k8s_fleet.py), with the real Vetoes, window, keeper and Event writer.

A veto set through one replica's API holds on every replica and on a pod that replaces one
(an eviction through the Eviction API, its ReplicaSet's successor); a lift on another replica
ends it everywhere; each writes an Event on the pod and the Deployment. The learned workload's
summary survives a rolling update, written at most once per interval and only when changed.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from kubernetes import client

from kvpilot.agent.app.fleet_keep import DeploymentKeeping
from kvpilot.agent.remediation.audit import AuditTrail
from kvpilot.agent.remediation.trigger import Trigger
from kvpilot.agent.remediation.vetoes import Vetoes
from kvpilot.agent.runtimes.kubernetes.fleet import decision_events as ev
from kvpilot.agent.runtimes.kubernetes.fleet.gate import pod_gate
from kvpilot.agent.runtimes.kubernetes.fleet.kept_guards import (
    KEY,
    MAX_VETOES,
    MAX_WORKLOAD_CHARS,
    WORKLOAD_KEY,
    KeptGuards,
)
from kvpilot.agent.tuning.workload.window import WorkloadWindow
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.tuning.workload_scrapes import served
from tests.fakes.k8s_fleet import FakeFleetApi
from tests.fakes.remediation_journal import MemoryJournal

DEPLOYMENT = "model-0"
CONFIGMAP = (NAMESPACE, f"{DEPLOYMENT}-kvpilot-guards")


def fleet_deployment(replicas: int) -> dict[str, Any]:
    body = base_deployment(8000)
    body["metadata"]["name"] = DEPLOYMENT
    body["spec"]["replicas"] = replicas
    return body


class Replica:
    """One sidecar's vetoes (its own journal), window and keeping, as compose wires them."""

    def __init__(self, api: Any, pod: str, *, window: WorkloadWindow | None = None) -> None:
        self.pod = pod
        journal = MemoryJournal()
        self.vetoes = Vetoes(journal, AuditTrail(journal, time.time), time.time, time.monotonic)
        gate = pod_gate(api, namespace=NAMESPACE, deployment=DEPLOYMENT, pod=pod)
        self.window = window
        self.keeping = DeploymentKeeping(
            gate.kept, gate.events, self.vetoes, window, min_requests=50
        )

    def vetoed(self) -> str | None:
        return self.vetoes.against(Trigger(DEPLOYMENT, "manual", None, None))


def pods(fake: FakeFleetApi) -> list[str]:
    return [p["metadata"]["name"] for p in fake.pods_of(NAMESPACE, DEPLOYMENT)]


def evict(fake: FakeFleetApi, pod: str) -> str:
    """A node drain: the pod evicted through the Eviction API; its successor's name."""
    client.CoreV1Api(fake.api_client()).create_namespaced_pod_eviction(
        pod, NAMESPACE, client.V1Eviction(metadata=client.V1ObjectMeta(name=pod))
    )
    return fake.replaced[pod]


def events(fake: FakeFleetApi, reason: str) -> set[tuple[str, str]]:
    return {
        (e["involvedObject"]["kind"], e["involvedObject"]["name"])
        for e in fake.events.values()
        if e["reason"] == reason
    }


def kept_doc(fake: FakeFleetApi, key: str = KEY) -> Any:
    return json.loads(fake.config_maps[CONFIGMAP]["data"][key])


def test_a_veto_holds_on_every_replica_and_a_replaced_pod_and_a_lift_ends_it_everywhere() -> None:
    with FakeFleetApi() as fake:
        fake.add_deployment(fleet_deployment(2))
        api = fake.api_client()
        a, b = (Replica(api, pod) for pod in pods(fake))

        async def scenario() -> None:
            await a.keeping.start()
            await b.keeping.start()
            a.vetoes.add(
                requested_by="oncall", reason="disk work", instance=DEPLOYMENT, duration_s=3600
            )
            await a.keeping.sync_vetoes()
            await b.keeping.sync_vetoes()
            assert b.vetoed() == f"vetoed: instance {DEPLOYMENT} is vetoed"
            # The pod that set it is drained away; its successor starts with an empty journal.
            c = Replica(api, evict(fake, a.pod))
            await c.keeping.start()
            assert c.vetoed() is not None
            assert c.vetoes.active()[0].until_wall_s == pytest.approx(time.time() + 3600, abs=5)
            # Lifted on another replica: gone there, then here at the next round.
            assert b.vetoes.lift(requested_by="oncall", reason="done", instance=DEPLOYMENT)
            await b.keeping.sync_vetoes()
            await c.keeping.sync_vetoes()
            assert b.vetoed() is None and c.vetoed() is None

        asyncio.run(scenario())
        assert kept_doc(fake)["vetoes"] == []
        # One Event per decision, on the replica that took it and on the Deployment.
        assert events(fake, ev.VETOED) == {("Pod", a.pod), ("Deployment", DEPLOYMENT)}
        assert events(fake, ev.VETO_LIFTED) == {("Pod", b.pod), ("Deployment", DEPLOYMENT)}


def test_a_veto_whose_write_fails_holds_here_and_is_kept_at_the_next_round() -> None:
    with FakeFleetApi() as fake:
        fake.add_deployment(fleet_deployment(2))
        api = fake.api_client()
        a, b = (Replica(api, pod) for pod in pods(fake))

        async def scenario() -> None:
            await a.keeping.start()
            await b.keeping.start()
            fake.forbidden.add(("create", "configmaps"))  # RBAC not yet applied, say
            a.vetoes.add(requested_by="oncall", reason="hold", instance=DEPLOYMENT)
            await a.keeping.sync_vetoes()
            assert a.vetoed() is not None  # not kept yet, and not dropped for it
            assert not events(fake, ev.VETOED)  # the Event follows the kept write
            fake.forbidden.clear()
            await a.keeping.sync_vetoes()
            await b.keeping.sync_vetoes()

        asyncio.run(scenario())
        assert a.vetoed() is not None and b.vetoed() is not None
        assert [v["target"] for v in kept_doc(fake)["vetoes"]] == [DEPLOYMENT]


def test_kept_vetoes_are_bounded_and_the_ended_ones_dropped_on_write() -> None:
    with FakeFleetApi() as fake:
        kept = KeptGuards(fake.api_client(), namespace=NAMESPACE, deployment=DEPLOYMENT)
        now = time.time()
        ended = {"kind": "instance", "target": "old", "until_wall_s": now - 1, "reason": "x"}
        kept.put_veto(ended)
        for n in range(MAX_VETOES + 8):
            row = {"kind": "incident", "target": f"i{n}", "reason": "r" * 1000}
            kept.put_veto({**row, "until_wall_s": now + 60, "since_wall_s": now})
        rows = kept_doc(fake)["vetoes"]
        assert len(rows) == MAX_VETOES and "old" not in {r["target"] for r in rows}
        assert rows[-1]["target"] == f"i{MAX_VETOES + 7}"  # the newest are the ones kept
        assert len(rows[0]["reason"]) == 200
        assert not kept.lift_veto("instance", "old")
        # The guards' other keys are untouched by the workload's, and the other way round.
        kept.note("p", restart_wall_s=now, breaker=None, decision=None)
        kept.keep_workload({"format": 1})
        assert kept.workload() == {"format": 1} and len(kept.vetoes()) == MAX_VETOES
        with pytest.raises(ValueError, match="above"):
            kept.keep_workload({"minutes": ["x" * MAX_WORKLOAD_CHARS]})


def test_the_learned_workload_outlives_a_rolling_update_and_is_written_only_when_changed() -> None:
    with FakeFleetApi() as fake:
        fake.add_deployment(fleet_deployment(2))
        api = fake.api_client()
        window = WorkloadWindow(3600)
        first, second = pods(fake)
        a = Replica(api, first, window=window)

        def configmap_writes() -> int:
            return len([r for r in fake.writes() if "/configmaps" in r.path])

        async def scenario() -> WorkloadWindow:
            assert await a.keeping.start() == "the Deployment keeps no workload yet"
            window.observe(served(0, at_s=time.monotonic() - 600))
            window.observe(served(30, at_s=time.monotonic() - 300))
            await a.keeping.keep_workload()
            assert WORKLOAD_KEY not in fake.config_maps.get(CONFIGMAP, {}).get("data", {})
            window.observe(served(300, at_s=time.monotonic()))  # above min_requests now
            await a.keeping.keep_workload()
            written = configmap_writes()
            window.observe(served(400, at_s=time.monotonic() + 0.5))
            await a.keeping.keep_workload()  # changed, but within the interval: not written
            assert configmap_writes() == written
            # A rolling update: the new pod's sidecar has no state of its own.
            fresh = WorkloadWindow(3600)
            b = Replica(api, evict(fake, second), window=fresh)
            said = await b.keeping.start()
            assert said == "from the Deployment: restored 300 requests of the kept window"
            await b.keeping.keep_workload()  # what it read back is no change to write
            assert configmap_writes() == written
            return fresh

        fresh = asyncio.run(scenario())
        kept = kept_doc(fake, WORKLOAD_KEY)
        assert len(kept["minutes"]) == 1  # the summary, not the samples
        shape = fresh.shape()
        assert shape is not None and shape.requests == 300
        assert shape.prompt_tokens.count == 300 and shape.block_size == 16
        assert shape.rate_rps == pytest.approx(300 / 600, rel=0.01)
