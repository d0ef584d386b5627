"""Scheduled tuning on the pod runtime: the study read from the Deployment, each run under
the Deployment's Lease. Against the fake API server (a fake: no API server runs here);
`remediation.dry_run` keeps the runs to their plans."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvpilot.agent.app.parts import build_pod_runtime, pod_tuner, scheduled_tuning_of
from kvpilot.agent.config import PodRuntimeConfig, validate_config
from kvpilot.agent.runtimes.device_memory import server_device_memory_bytes
from kvpilot.agent.runtimes.kubernetes.lease import DeploymentLease, lease_name
from kvpilot.agent.runtimes.kubernetes.traffic import GatewayWeights
from kvpilot.agent.state import StateStore
from kvpilot.agent.tick.after import CompletedRuns
from kvpilot.agent.tuning.pod.live_observer import LiveTrafficObserver
from kvpilot.agent.tuning.study import make_observer
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.remediation.remediation_helpers import Harness, remediation_config

TINY = Path(__file__).resolve().parents[3] / "rig" / "models" / "tiny-llama"


def scheduled(fake, tmp_path: Path, port: int, **tuning: object):
    config = validate_config(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "pod",
                "port": port,
                "model_config": str(TINY),
                "kubernetes": {"namespace": NAMESPACE, "deployment": "vllm", "api_url": fake.host},
            },
            "tuning": {
                "schedule": "0 3 * * *",
                "trials": 2,
                "memory_knob": "kv_cache_memory_bytes",
                **tuning,
            },
        },
        warn=False,
    )
    assert isinstance(config.runtime, PodRuntimeConfig)
    runtime = build_pod_runtime(config, config.runtime, {"POD_NAME": "pod-a"})
    store = StateStore.open(config.state_dir)
    remediator = Harness(remediation_config(dry_run=True)).remediator
    tuning = scheduled_tuning_of(
        config,
        None,
        (runtime, remediator, store),
        api_key=None,
        vllm_version=lambda: None,
        workload=lambda: None,
        completed_runs=CompletedRuns(),
    )
    assert tuning is not None
    return tuning, store


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
    other = DeploymentLease(
        fake.api_client(), namespace=NAMESPACE, deployment="vllm", identity="pod-b"
    )

    async def main() -> str:
        await tuning.start_up()
        await asyncio.to_thread(other.acquire)
        return await tuning.fire()

    outcome = asyncio.run(main())

    assert outcome.startswith("skipped: "), outcome
    assert "held by 'pod-b'" in outcome
    store.close()


def test_a_pod_tuner_on_live_traffic_splits_it_through_the_configured_route(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    config = validate_config(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "pod",
                "port": 8000,
                "model_config": str(TINY),
                "kubernetes": {"namespace": NAMESPACE, "deployment": "vllm", "api_url": fake.host},
            },
            "tuning": {
                "trials": 1,
                "memory_knob": "kv_cache_memory_bytes",
                "canary": {
                    "traffic": "gateway",
                    "weight_percent": 10,
                    "gateway": {
                        "httproute": "vllm",
                        "stable_service": "vllm",
                        "canary_service": "vllm-kvpilot-canary",
                    },
                },
            },
        },
        warn=False,
    )
    assert isinstance(config.runtime, PodRuntimeConfig)
    runtime = build_pod_runtime(config, config.runtime, {"POD_NAME": "pod-a"})
    store = StateStore.open(config.state_dir)
    tuner = pod_tuner(config.runtime, config.tuning, runtime, store.db)

    asyncio.run(tuner.study())

    assert isinstance(tuner.traffic, GatewayWeights)
    assert tuner.adapter._traffic is tuner.traffic  # the canary's share comes back first
    observer, _ = make_observer(
        asyncio.run(tuner.study()),
        device_memory=server_device_memory_bytes,
        live=tuner.live_observer(),
    )
    assert isinstance(observer, LiveTrafficObserver)
    store.close()


def test_a_pod_replay_sends_the_learned_workload_live_traffic_does_not(fake, tmp_path) -> None:
    from kvpilot.agent.config.tuning import TuningConfig
    from kvpilot.agent.tuning.workload.choice import WorkloadChoice, choose_workload
    from kvpilot.agent.tuning.workload.window import WorkloadWindow
    from tests.agent.tuning.workload_scrapes import served

    fake.add_deployment(base_deployment(8000))
    store = StateStore.open(tmp_path / "state")
    window = WorkloadWindow(3600)
    window.observe(served(0, at_s=0.0, prompt=300))
    window.observe(served(400, at_s=400.0, prompt=300))
    learned = choose_workload(TuningConfig(), window.shape())
    assert learned.source == "learned"
    replay = _config(fake, tmp_path, "replay")
    offered: list[WorkloadChoice | None] = [None]  # what the window offers: nothing yet
    runtime = build_pod_runtime(replay, replay.runtime, {"POD_NAME": "a"})
    tuner = pod_tuner(replay.runtime, replay.tuning, runtime, store.db, workload=lambda: offered[0])
    configured = asyncio.run(tuner.study())
    offered[0] = learned
    study = asyncio.run(tuner.study())
    assert study.choice == learned and study.workload == learned.workload
    assert study.fingerprint != configured.fingerprint  # the coarse shape is in it

    live = _config(fake, tmp_path, "gateway")
    runtime = build_pod_runtime(live, live.runtime, {"POD_NAME": "a"})
    tuner = pod_tuner(live.runtime, live.tuning, runtime, store.db, workload=lambda: learned)
    assert asyncio.run(tuner.study()).choice != learned  # live traffic is its own workload
    store.close()


def _config(fake, tmp_path: Path, traffic: str):  # type: ignore[no-untyped-def]
    canary = {"traffic": traffic}
    if traffic == "gateway":
        canary |= {
            "gateway": {
                "httproute": "vllm",
                "stable_service": "vllm",
                "canary_service": "vllm-kvpilot-canary",
            }
        }
    config = validate_config(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "pod",
                "port": 8000,
                "model_config": str(TINY),
                "kubernetes": {"namespace": NAMESPACE, "deployment": "vllm", "api_url": fake.host},
            },
            "tuning": {"trials": 1, "memory_knob": "kv_cache_memory_bytes", "canary": canary},
        },
        warn=False,
    )
    assert isinstance(config.runtime, PodRuntimeConfig)
    return config
