"""The Kubernetes adapter on live traffic: the canary's share goes back before the canary is
deleted, and a canary whose share cannot be taken back keeps serving; `make_observer`
picks the observer by `tuning.canary.traffic`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from kvpilot.agent.config.tuning import CanaryConfig, TuningConfig
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.device_memory import server_device_memory_bytes
from kvpilot.agent.tuning.observer import LoadObserver
from kvpilot.agent.tuning.pod import adapter as kubernetes_adapter
from kvpilot.agent.tuning.pod.adapter import KubernetesTunerAdapter
from kvpilot.agent.tuning.pod.live_observer import LiveTrafficObserver
from kvpilot.agent.tuning.server import TunedServer
from kvpilot.agent.tuning.study import Study, StudyError, make_observer
from kvpilot.tuner.judge.judgement import LIVE_METRICS
from kvpilot.tuner.load.generator import LengthDist, Workload
from kvpilot.tuner.problem.objective import Slo
from kvpilot.tuner.problem.space import Knob, KnobKind, SearchSpace
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime

CANARY = "vllm-kvpilot-canary"


@dataclass(frozen=True)
class Split:
    stable_percent: float
    canary_percent: float
    how: str = "HTTPRoute vllm weights"


class SplitDouble:
    """Records each pull-back with the DELETEs the fake API server had seen by then."""

    def __init__(self, fake, *, fails: bool = False, sticks: bool = False) -> None:
        self.fake, self.fails, self.sticks = fake, fails, sticks
        self.pulls: list[int] = []

    async def send_share(self, canary_percent: float) -> Split:
        return Split(100 - canary_percent, canary_percent)

    async def pull_back(self) -> Split:
        self.pulls.append(len(self.fake.writes("DELETE")))
        if self.fails:
            raise ConnectionError("the API server is unreachable")
        return Split(90.0, 10.0) if self.sticks else Split(100.0, 0.0)

    async def shares(self) -> Split:
        return Split(100.0, 0.0)


def started(fake, standin, tmp_path, split: SplitDouble) -> KubernetesTunerAdapter:
    fake.add_deployment(base_deployment(standin.port))
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")
    adapter = KubernetesTunerAdapter(runtime, drain_timeout_s=5, traffic=split)
    asyncio.run(adapter.start_canary(("--max-num-seqs", "8"), ready_timeout_s=10))
    assert fake.deployment(NAMESPACE, CANARY) is not None
    return adapter


def test_the_share_goes_back_before_the_canary_is_deleted(fake, standin, tmp_path) -> None:
    split = SplitDouble(fake)
    adapter = started(fake, standin, tmp_path, split)

    asyncio.run(adapter.stop_canary())

    assert split.pulls == [0]  # before any DELETE
    assert any(w.path.endswith(f"/deployments/{CANARY}") for w in fake.writes("DELETE"))
    assert adapter.pulled_back == ["stable 100 %, canary 0 % (HTTPRoute vllm weights)"]


@pytest.mark.parametrize(
    ("split_kwargs", "says"),
    [
        ({"fails": True}, "could not be sent back to the stable pods \\(ConnectionError"),
        ({"sticks": True}, "the split still sends it traffic \\(stable 90 %, canary 10 %"),
    ],
)
def test_a_canary_whose_share_cannot_come_back_keeps_serving(
    fake, standin, tmp_path, split_kwargs, says, monkeypatch
) -> None:
    monkeypatch.setattr(kubernetes_adapter, "PULL_BACK_PAUSE_S", 0.01)  # tried three times, quickly
    split = SplitDouble(fake, **split_kwargs)
    adapter = started(fake, standin, tmp_path, split)

    with pytest.raises(RuntimeFailure, match=f"the canary keeps running: .*{says}"):
        asyncio.run(adapter.stop_canary())

    assert fake.writes("DELETE") == []
    assert fake.deployment(NAMESPACE, CANARY) is not None


def study(canary: dict[str, object]) -> Study:
    tuning = TuningConfig.model_validate({"canary": canary})
    argv = ("python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m")
    workload = Workload(4, LengthDist.fixed(8), LengthDist.fixed(4), concurrency=2)
    space = SearchSpace(knobs=(Knob("max_num_seqs", KnobKind.INTEGER, 1, 8),))
    stable = TunedServer("vllm", argv, ready_timeout_s=60.0, drain_timeout_s=30.0)
    return Study(tuning, stable, argv, space, workload, Slo(), "fp", 60.0)


def test_the_observer_follows_the_canary_traffic_setting(fake) -> None:
    measured = server_device_memory_bytes
    replay, judged = make_observer(study({}), device_memory=measured)
    assert isinstance(replay, LoadObserver) and judged.metrics != LIVE_METRICS

    live_study = study({"traffic": "gateway", "gateway": {}})
    with pytest.raises(StudyError, match="canary traffic gateway splits live traffic"):
        make_observer(live_study, device_memory=measured)

    def through_the_split(canary: CanaryConfig, slo: Slo) -> LiveTrafficObserver:
        return LiveTrafficObserver(canary, SplitDouble(fake), slo)

    live, judged = make_observer(live_study, device_memory=measured, live=through_the_split)
    assert isinstance(live, LiveTrafficObserver) and judged.metrics == LIVE_METRICS


def test_the_split_is_built_from_the_canary_settings_and_the_stable_deployment(fake) -> None:
    from kvpilot.agent.config.tuning import CanaryConfig
    from kvpilot.agent.runtimes.kubernetes.traffic import GatewayWeights, ServiceShare
    from kvpilot.agent.runtimes.kubernetes.values import KubernetesTarget
    from kvpilot.agent.tuning.pod.adapter import traffic_split

    fake.add_deployment(base_deployment(8000))
    target = KubernetesTarget(namespace=NAMESPACE, deployment="vllm")
    wanted = {"kvpilot.dev/canary-of": "vllm", "kvpilot.dev/role": "canary"}

    assert traffic_split(CanaryConfig(), fake.api_client(), target) is None
    service = traffic_split(CanaryConfig(traffic="service"), fake.api_client(), target)
    assert isinstance(service, ServiceShare)
    assert (service.service, service.canary_selector) == ("vllm", wanted)
    gateway = traffic_split(
        CanaryConfig.model_validate({"traffic": "gateway", "gateway": {"httproute": "llm"}}),
        fake.api_client(),
        target,
    )
    assert isinstance(gateway, GatewayWeights)
    assert (gateway.route, gateway.stable_service) == ("llm", "vllm")
    assert (gateway.canary_service, gateway.canary_selector) == ("vllm-kvpilot-canary", wanted)
