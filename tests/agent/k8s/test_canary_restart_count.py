"""A live canary's container restarts count against it: the kubelet's `restartCount` of the
canary's vLLM container, read from the fake API server (a fake: no API server runs here)
beside each scrape, aborts the analysis when it rises during the trial, even where vLLM's
counters hide the crash (the container was back before the next scrape). Stand-in vLLM
/metrics and a recording split double."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from kvpilot.agent.app.parts import build_pod_runtime, pod_tuner
from kvpilot.agent.config import PodRuntimeConfig, validate_config
from kvpilot.agent.runtimes.kubernetes.restarts import CanaryRestarts, restart_count
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.pod.live_observer import LiveTrafficObserver
from kvpilot.tuner.rollout.ports import CanaryAborted
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime
from tests.agent.k8s.test_live_traffic_adapter import CANARY
from tests.agent.k8s.test_pod_schedule import TINY
from tests.agent.tuning.test_live_observer import (
    CONFIG,
    SLO,
    PodScript,
    RecordingSplit,
    Step,
    SteppedClock,
    url,
)
from tests.fakes.standin_vllm import StandInVllm


@pytest.fixture
def canary_pod() -> Iterator[StandInVllm]:
    with StandInVllm() as pod:
        yield pod


def with_canary(fake, standin, tmp_path) -> CanaryRestarts:
    """The stable Deployment and a canary started from it; the reader of its restarts."""
    fake.add_deployment(base_deployment(standin.port))
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")
    asyncio.run(runtime.start_canary(("--max-num-seqs", "8"), ready_timeout_s=10))
    return CanaryRestarts(fake.api_client(), runtime.target)


def healthy_then(after: int, event: Callable[[], None]) -> Callable[[], str]:
    """A canary's /metrics that never shows a reset; `event` happens at scrape `after`."""
    script = PodScript([Step(9)])
    scrapes = [0]

    def metrics() -> str:
        scrapes[0] += 1
        if scrapes[0] == after:
            event()
        return script.render()

    return metrics


def analyse(stable, canary, restarts) -> tuple[RecordingSplit, LiveTrafficObserver, Exception]:
    split, clock = RecordingSplit(canary), SteppedClock()
    live = LiveTrafficObserver(
        CONFIG, split, SLO, sleep=clock.sleep, clock=clock, wall_clock=clock, restarts=restarts
    )

    async def run() -> Exception | None:
        try:
            await live.warm([url(stable), url(canary)])
            await live.observe([url(stable), url(canary)])
        except CanaryAborted as exc:
            return exc
        return None

    return split, live, asyncio.run(run())


def test_a_restart_the_counters_hide_aborts_the_canary(fake, standin, canary_pod, tmp_path) -> None:
    restarts = with_canary(fake, standin, tmp_path)
    standin.metrics = PodScript([Step(9)]).render
    canary_pod.metrics = healthy_then(3, lambda: fake.restart_containers(NAMESPACE, CANARY))

    split, _, aborted = analyse(standin, canary_pod, restarts)

    assert aborted is not None, "a canary whose container restarted was judged"
    assert "restarted 1 times during the trial (restartCount 0 -> 1)" in str(aborted)
    assert [c for c, _ in split.calls] == ["send_share", "pull_back"]


def test_a_canary_that_does_not_restart_is_judged(fake, standin, canary_pod, tmp_path) -> None:
    restarts = with_canary(fake, standin, tmp_path)
    standin.metrics = PodScript([Step(9)]).render
    canary_pod.metrics = PodScript([Step(9)]).render

    split, _, aborted = analyse(standin, canary_pod, restarts)

    assert aborted is None
    assert [c for c, _ in split.calls] == ["send_share"]


def test_an_unread_restart_count_is_unknown_not_a_crash(
    fake, standin, canary_pod, tmp_path
) -> None:
    restarts = with_canary(fake, standin, tmp_path)
    standin.metrics = PodScript([Step(9)]).render
    refuse = lambda: fake.fail("GET", r"/pods$", 500)  # noqa: E731
    canary_pod.metrics = healthy_then(2, refuse)

    _, live, aborted = analyse(standin, canary_pod, restarts)

    assert aborted is None
    assert any("restartCount" in e and "HTTP 500" in e for e in live.scrape_errors), (
        live.scrape_errors
    )


def test_restart_count_reads_the_named_container_only() -> None:
    pod = {
        "status": {
            "containerStatuses": [
                {"name": "kvpilot", "restartCount": 7},
                {"name": "vllm", "restartCount": 2},
            ]
        }
    }
    assert restart_count(pod, "vllm") == 2
    assert restart_count(pod, "other") is None
    assert restart_count({"status": {}}, "vllm") is None


def test_the_pod_tuners_live_sessions_read_the_canarys_restarts(fake, tmp_path) -> None:
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
                    "gateway": {
                        "httproute": "vllm",
                        "stable_service": "vllm",
                        "canary_service": CANARY,
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

    observer = tuner.session(asyncio.run(tuner.study()))._observer

    assert isinstance(observer, LiveTrafficObserver)
    assert observer._restarts is tuner.restarts
    assert tuner.restarts() is None  # no canary yet: nothing to count
    store.close()
