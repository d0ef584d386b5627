"""The fleet's parts built into the pod runtime: the Deployment found from ownerReferences,
every restart of the stable behind its Deployment's gate, a replaced pod's guards taken over
at start-up, `restart: rollout` refused with several replicas, and a waiting replica's poll
kept to one read of the Lease. Against the fake API server with a fleet's objects."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from kvpilot.agent.app.fleet_start import take_over_kept_guards
from kvpilot.agent.app.parts import build_pod_runtime
from kvpilot.agent.config import PodRuntimeConfig, validate_config
from kvpilot.agent.remediation import Remediator
from kvpilot.agent.runtimes import RuntimeFailure, RuntimeUnsupported
from kvpilot.agent.runtimes.kubernetes.fleet.gate import pod_gate
from kvpilot.agent.runtimes.kubernetes.fleet.kept_guards import KeptGuards
from kvpilot.agent.runtimes.kubernetes.pod import PodRuntime
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.remediation.remediation_helpers import remediation_config
from tests.fakes.k8s_fleet import FakeFleetApi
from tests.fakes.remediation_journal import MemoryJournal


def fleet_deployment(replicas: int) -> dict[str, Any]:
    body = base_deployment(8000)
    body["metadata"]["name"] = "model-0"
    body["spec"]["replicas"] = replicas
    return body


def pod_runtime(fake: FakeFleetApi, tmp_path: Path, pod: str | None, **k8s: Any) -> PodRuntime:
    config = validate_config(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "pod",
                "name": "llm",
                "port": 8000,
                "kubernetes": {"namespace": NAMESPACE, "api_url": fake.host, **k8s},
            },
        },
        warn=False,
    )
    assert isinstance(config.runtime, PodRuntimeConfig)
    environ = {} if pod is None else {"POD_NAME": pod}
    return build_pod_runtime(config, config.runtime, environ)


def test_an_unset_deployment_is_the_pods_own_and_its_restarts_take_turns(tmp_path: Path) -> None:
    with FakeFleetApi() as fake:
        fake.add_deployment(fleet_deployment(3))
        pod = fake.pods_of(NAMESPACE, "model-0")[0]["metadata"]["name"]
        runtime = pod_runtime(fake, tmp_path, pod, restarting_at_once=2)
        assert runtime.target.deployment == "model-0"  # pod -> ReplicaSet -> Deployment
        gate = runtime.restart_gate
        assert gate is not None
        assert (gate.slots.name, gate.slots.slots, gate.slots.identity) == (
            "model-0-kvpilot-restarts",
            2,
            pod,
        )
        assert gate.kept.name == "model-0-kvpilot-guards"
        # Without its pod's name it cannot find its Deployment, and says how to set it.
        with pytest.raises(RuntimeFailure, match=r"kubernetes\.deployment is unset"):
            pod_runtime(fake, tmp_path, None)


def test_a_replacing_pod_takes_over_the_guards_at_start_up(tmp_path: Path) -> None:
    with FakeFleetApi() as fake:
        fake.add_deployment(fleet_deployment(2))
        api = fake.api_client()
        first = fake.pods_of(NAMESPACE, "model-0")[0]["metadata"]["name"]
        opened = {"failures": 3, "opened_at_wall_s": time.time() - 10, "trial_in_flight": False}
        kept = KeptGuards(api, namespace=NAMESPACE, deployment="model-0")
        kept.note(first, restart_wall_s=time.time() - 20, breaker=opened, decision=None)
        client.CoreV1Api(api).create_namespaced_pod_eviction(
            first, NAMESPACE, client.V1Eviction(metadata=client.V1ObjectMeta(name=first))
        )
        successor = fake.replaced[first]
        runtime = pod_runtime(fake, tmp_path, successor)
        remediator = Remediator(runtime, MemoryJournal(), remediation_config())

        record = asyncio.run(take_over_kept_guards(runtime, remediator))

        assert record is not None and record.breaker == opened
        now = time.monotonic()
        assert remediator.budget.used("llm", now) == 1
        assert remediator.breaker.state("llm", now) == "open"
        assert kept.record(successor).breaker == opened  # moved to the successor
        # Every later decision keeps the breaker as the remediator tells it.
        assert runtime.restart_gate is not None
        assert runtime.restart_gate._breaker_fact is not None
        assert runtime.restart_gate._breaker_fact()["failures"] == 3


def test_restart_rollout_is_refused_with_several_replicas(tmp_path: Path) -> None:
    with FakeFleetApi() as fake:
        fake.add_deployment(fleet_deployment(3))
        runtime = pod_runtime(fake, tmp_path, None, deployment="model-0", restart="rollout")
        with pytest.raises(RuntimeUnsupported, match="all 3 replicas"):
            asyncio.run(runtime.restart("llm", drain_timeout_s=1, ready_timeout_s=5))
        assert not fake.writes("PATCH")  # no rollout was started


def test_a_waiting_replica_polls_with_one_read_of_the_lease() -> None:
    with FakeFleetApi() as fake:
        fake.add_deployment(fleet_deployment(2))
        api = fake.api_client()
        holder, waiter = (p["metadata"]["name"] for p in fake.pods_of(NAMESPACE, "model-0"))
        args = {"namespace": NAMESPACE, "deployment": "model-0"}
        assert pod_gate(api, pod=holder, **args).slots.try_take("restart").granted
        gate = pod_gate(api, pod=waiter, **args)
        before = len(fake.requests)

        blocked = asyncio.run(gate._try_once("restart", by_signal=True))

        assert blocked is not None and holder in blocked
        asked = [(r.method, r.path.rsplit("/", 2)[-2]) for r in fake.requests[before:]]
        assert asked == [("GET", "leases")]  # no PDB list, no write while the slot is held
