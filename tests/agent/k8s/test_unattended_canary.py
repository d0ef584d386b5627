"""A canary left serving with nobody attending it is exported: a pull-back that failed after
its retries, or a canary no trial owns, marks its Deployment in kvpilot_unattended_canaries
until the canary is gone. Against the fake API server (a fake: no API server runs here) and
a stand-in vLLM."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from kvpilot.agent.app.exposition import build_registry, sidecar_families
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.unattended import UNATTENDED, UnattendedCanaries
from kvpilot.agent.tick.views import SidecarCounters
from kvpilot.agent.tuning.pod import adapter as kubernetes_adapter
from kvpilot.agent.tuning.pod.adapter import KubernetesTunerAdapter
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime
from tests.agent.k8s.test_live_traffic_adapter import CANARY, SplitDouble
from tests.agent.k8s.test_orphan_canary import evicted_mid_trial

DEPLOYMENT = f"{NAMESPACE}/vllm"


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch) -> None:
    monkeypatch.setattr(kubernetes_adapter, "PULL_BACK_PAUSE_S", 0.01)


def adapter(fake, standin, tmp_path, split: SplitDouble, unattended: UnattendedCanaries):
    runtime = make_runtime(fake, standin.port, tmp_path)
    return KubernetesTunerAdapter(runtime, drain_timeout_s=5, traffic=split, unattended=unattended)


def test_a_pull_back_that_fails_its_retries_marks_the_canary_until_it_is_removed(
    fake, standin, tmp_path
) -> None:
    fake.add_deployment(base_deployment(standin.port))
    unattended = UnattendedCanaries()
    split = SplitDouble(fake, fails=True)
    tuner = adapter(fake, standin, tmp_path, split, unattended)
    asyncio.run(tuner.start_canary(("--max-num-seqs", "8"), ready_timeout_s=10))

    with pytest.raises(RuntimeFailure, match="could not be sent back"):
        asyncio.run(tuner.stop_canary())

    assert len(split.pulls) == kubernetes_adapter.PULL_BACK_TRIES
    assert unattended.series() == ((DEPLOYMENT, 1.0),)
    assert fake.deployment(NAMESPACE, CANARY) is not None  # kept serving, not cut off
    split.fails = False  # the API server lets the pull-back through again
    asyncio.run(tuner.stop_canary())
    assert unattended.series() == ((DEPLOYMENT, 0.0),)  # kept at 0: the alert resolves
    assert fake.deployment(NAMESPACE, CANARY) is None


def test_a_share_that_sticks_marks_the_canary(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    unattended = UnattendedCanaries()
    tuner = adapter(fake, standin, tmp_path, SplitDouble(fake, sticks=True), unattended)
    asyncio.run(tuner.start_canary(("--max-num-seqs", "8"), ready_timeout_s=10))

    with pytest.raises(RuntimeFailure, match="still sends it traffic"):
        asyncio.run(tuner.stop_canary())

    assert unattended.series() == ((DEPLOYMENT, 1.0),)


def test_an_orphan_whose_share_cannot_come_back_stays_marked(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    evicted_mid_trial(fake, standin, tmp_path / "b")
    unattended = UnattendedCanaries()
    tuner = adapter(fake, standin, tmp_path / "a", SplitDouble(fake, fails=True), unattended)

    with pytest.raises(RuntimeFailure):
        asyncio.run(tuner.sweep_orphaned_canary())

    assert unattended.series() == ((DEPLOYMENT, 1.0),)


def test_an_orphan_cleaned_up_is_marked_no_longer(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    evicted_mid_trial(fake, standin, tmp_path / "b")
    unattended = UnattendedCanaries()
    tuner = adapter(fake, standin, tmp_path / "a", SplitDouble(fake), unattended)

    assert asyncio.run(tuner.sweep_orphaned_canary()) is not None

    assert unattended.series() == ((DEPLOYMENT, 0.0),)


def test_the_sidecar_exports_the_process_wide_record() -> None:
    counters = SidecarCounters((), None, (), (), (), False)
    UNATTENDED.mark("elsewhere/model-a")
    try:
        registry = build_registry(lambda: (), sidecar_families(lambda: counters))
        text = generate_latest(registry).decode()
    finally:
        UNATTENDED.clear("elsewhere/model-a")
    assert 'kvpilot_unattended_canaries{deployment="elsewhere/model-a"} 1.0' in text
