"""Scheduled tuning on the pod runtime: the study read from the Deployment, each run under
the Deployment's Lease. Against the fake API server (a fake: no API server runs here);
`remediation.dry_run` keeps the runs to their plans."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvpilot.agent.app.parts import build_pod_runtime
from kvpilot.agent.config import PodRuntimeConfig, validate_config
from kvpilot.agent.runtimes.k8s_lease import DeploymentLease, lease_name
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.schedule import pod_scheduled_tuning
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.remediation.remediation_helpers import Harness, remediation_config

TINY = Path(__file__).resolve().parents[3] / "rig" / "models" / "tiny-llama"


def scheduled(fake, tmp_path: Path, port: int):
    config = validate_config({
        "state_dir": str(tmp_path / "state"),
        "runtime": {"kind": "pod", "port": port, "model_config": str(TINY),
                    "kubernetes": {"namespace": NAMESPACE, "api_url": fake.host}},
        "tuning": {"schedule": "0 3 * * *", "trials": 2,
                   "memory_knob": "kv_cache_memory_bytes"},
    }, warn=False)  # fmt: skip
    assert isinstance(config.runtime, PodRuntimeConfig)
    runtime = build_pod_runtime(config, config.runtime, {"POD_NAME": "pod-a"})
    store = StateStore.open(config.state_dir)
    remediator = Harness(remediation_config(dry_run=True)).remediator
    return pod_scheduled_tuning(config, runtime, remediator, store), store


def test_a_firing_plans_from_the_deployments_flags_under_its_lease(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    tuning, store = scheduled(fake, tmp_path, 8000)

    async def main() -> str:
        await tuning.start_up()
        return await tuning.fire()

    outcome = asyncio.run(main())

    assert outcome.startswith("finished: dry-run: would try "), outcome
    assert "kv_cache_memory_bytes=" in outcome
    lease = fake.leases[(NAMESPACE, lease_name("vllm"))]
    assert lease["spec"].get("holderIdentity") in (None, "")  # taken, then given back
    taken = [w for w in fake.writes("PUT") if w.path.endswith(lease_name("vllm"))]
    assert any(w.body["spec"].get("holderIdentity") == "pod-a" for w in taken)
    decisions = [a.decision for a in store.audit_records()]
    assert decisions[:2] == ["finished", "started"]
    store.close()


def test_a_firing_while_another_pod_holds_the_lease_is_skipped(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    tuning, store = scheduled(fake, tmp_path, 8000)
    other = DeploymentLease(fake.api_client(), namespace=NAMESPACE, deployment="vllm",
                            identity="pod-b")  # fmt: skip

    async def main() -> str:
        await tuning.start_up()
        await asyncio.to_thread(other.acquire)
        return await tuning.fire()

    outcome = asyncio.run(main())

    assert outcome.startswith("skipped: "), outcome
    assert "held by 'pod-b'" in outcome
    store.close()
