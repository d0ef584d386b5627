"""Per-Deployment settings read from the sidecar's own Deployment (found from its
ownerReferences) at start-up and at each reload, through the real client against the fake API
server (a fake: no API server runs here): the start-up's one GET, the refused annotations'
Warning Event, the API server away, `kubectl annotate` and a reload."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpilot.agent.app.compose import run_sidecar
from kvpilot.agent.app.deployment_settings import DeploymentSettings
from kvpilot.agent.app.parts import build_pod_runtime, deployment_settings, pod_place
from kvpilot.agent.app.reload import Reloader
from kvpilot.agent.config import AgentConfig, NotifierConfig, PodRuntimeConfig, validate_config
from kvpilot.agent.notify import Notifier
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.agent.state import StateStore
from kvpilot.rig.server import free_port
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.k8s.test_fleet_wiring import fleet_deployment
from tests.fakes.k8s_apiserver import FakeKubernetesApi
from tests.fakes.k8s_fleet import FakeFleetApi
from tests.fakes.standin_vllm import StandInVllm

DEPLOYMENT_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/model-0"


@pytest.fixture
def fleet() -> Iterator[FakeFleetApi]:
    with FakeFleetApi() as fake:
        fake.add_deployment(fleet_deployment(2))
        yield fake


def annotate(fake: FakeFleetApi, **settings: str) -> None:
    """`kubectl annotate deployment model-0 kvpilot.dev/<path>=<value>` for each setting."""
    meta = fake.deployments[(NAMESPACE, "model-0")].obj["metadata"]
    annotations = meta.setdefault("annotations", {})
    annotations.update({f"kvpilot.dev/{path}": value for path, value in settings.items()})


def shared(fake: FakeFleetApi, tmp_path: Path, **tuning: Any) -> AgentConfig:
    """The namespace's one ConfigMap: no Deployment named, tuning on a schedule."""
    return validate_config(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "pod",
                "name": "llm",
                "port": 8000,
                "kubernetes": {"namespace": NAMESPACE, "api_url": fake.host},
            },
            "tuning": {"schedule": "0 3 * * *", **tuning},
        },
        warn=False,
    )


def own_settings(fake: FakeFleetApi, config: AgentConfig) -> tuple[DeploymentSettings, str]:
    assert isinstance(config.runtime, PodRuntimeConfig)
    pod = fake.pods_of(NAMESPACE, "model-0")[0]["metadata"]["name"]
    place = pod_place(config.runtime, {"POD_NAME": pod}, api_client=fake.api_client())
    return deployment_settings(place), pod


def refusals(fake: FakeFleetApi) -> list[dict[str, Any]]:
    return [e for e in fake.events.values() if e["reason"] == "KvpilotSettingsRefused"]


def test_start_up_lays_the_annotations_over_the_configmap_with_one_read(
    fleet: FakeFleetApi, tmp_path: Path
) -> None:
    annotate(
        fleet,
        **{
            "tuning.schedule": "30 2 * * *",
            "tuning.trials": "5",
            "runtime.kubernetes.restarting_at_once": "2",
        },
    )
    config = shared(fleet, tmp_path)
    assert isinstance(config.runtime, PodRuntimeConfig)
    pod = fleet.pods_of(NAMESPACE, "model-0")[0]["metadata"]["name"]
    environ = {"POD_NAME": pod}
    place = pod_place(config.runtime, environ, api_client=fleet.api_client())
    settings = deployment_settings(place)
    layered = settings.layer(config)
    assert isinstance(layered.runtime, PodRuntimeConfig)
    runtime = build_pod_runtime(layered, layered.runtime, environ, place=place)

    assert (layered.tuning.schedule, layered.tuning.trials) == ("30 2 * * *", 5)
    assert runtime.restart_gate is not None and runtime.restart_gate.slots.slots == 2
    assert settings.from_deployment == {
        "runtime.kubernetes.restarting_at_once": "2",
        "tuning.schedule": "30 2 * * *",
        "tuning.trials": "5",
    }
    # The owner found once (pod, ReplicaSet), the Deployment read once, nothing written.
    paths = [r.path for r in fleet.requests if r.method == "GET"]
    assert paths.count(DEPLOYMENT_PATH) == 1
    assert sum("/replicasets/" in p for p in paths) == 1 and len(paths) == 3
    assert fleet.writes() == [] and refusals(fleet) == []


def test_refused_annotations_leave_the_configmap_whole_and_say_so_once(
    fleet: FakeFleetApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    annotate(fleet, **{"tuning.trials": "7", "tuning.strategy": "parallel"})
    config = shared(fleet, tmp_path)
    settings, pod = own_settings(fleet, config)
    with caplog.at_level(logging.ERROR):
        assert settings.layer(config) is config  # the good one beside it is not applied
        assert settings.layer(config) is config  # a second reload: said already
    assert settings.from_deployment == {}
    (logged,) = [r.getMessage() for r in caplog.records if "settings refused" in r.getMessage()]
    assert "kvpilot.dev/tuning.strategy: not a per-Deployment setting" in logged
    events = refusals(fleet)
    assert sorted(e["involvedObject"]["kind"] for e in events) == ["Deployment", "Pod"]
    assert {e["type"] for e in events} == {"Warning"}
    assert all("kvpilot.dev/tuning.strategy" in e["message"] for e in events)
    assert {e["involvedObject"]["name"] for e in events} == {pod, "model-0"}

    # Fixed, then broken again by another value: the new refusal is said.
    annotations = fleet.deployments[(NAMESPACE, "model-0")].obj["metadata"]["annotations"]
    del annotations["kvpilot.dev/tuning.strategy"]
    assert settings.layer(config).tuning.trials == 7
    annotate(fleet, **{"tuning.trials": "0"})
    assert settings.layer(config) is config
    assert len(refusals(fleet)) == 4
    assert "kvpilot.dev/tuning.trials" in refusals(fleet)[-1]["message"]


def test_with_the_api_server_away_the_last_annotations_read_stand(
    fleet: FakeFleetApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = shared(fleet, tmp_path)
    settings, _ = own_settings(fleet, config)
    annotate(fleet, **{"tuning.trials": "5"})
    fleet.fail("GET", f"^{DEPLOYMENT_PATH}$", 503)
    with caplog.at_level(logging.WARNING):
        assert settings.layer(config) is config  # at start-up: the ConfigMap alone
    assert any("cannot read Deployment" in r.getMessage() for r in caplog.records)
    assert settings.layer(config).tuning.trials == 5  # back: read
    fleet.fail("GET", f"^{DEPLOYMENT_PATH}$", 503)
    again = shared(fleet, tmp_path, windows=4)  # a reload while it is away again
    layered = settings.layer(again)
    assert (layered.tuning.trials, layered.tuning.windows) == (5, 4)


class _Loop:
    def __init__(self) -> None:
        self.rules: list[RulesConfig] = []

    def use_notifiers(
        self, configs: tuple[NotifierConfig, ...], notifiers: Mapping[str, Notifier]
    ) -> None:
        pass

    def use_rules(self, rules: RulesConfig) -> None:
        self.rules.append(rules)


def test_kubectl_annotate_and_a_reload_apply_the_settings(
    fleet: FakeFleetApi, tmp_path: Path
) -> None:
    config = shared(fleet, tmp_path)
    settings, _ = own_settings(fleet, config)
    running = settings.layer(config)
    assert running == config  # no settings annotations yet
    loop = _Loop()

    async def layer(file_config: AgentConfig) -> AgentConfig:
        return await asyncio.to_thread(settings.layer, file_config)

    config.state_dir.mkdir(parents=True)
    with StateStore.open(config.state_dir) as store:
        reloader = Reloader(
            lambda: shared(fleet, tmp_path), running, loop, lambda c: {}, audit=store, layer=layer
        )
        annotate(
            fleet,
            **{"rules.kv_saturation.usage_threshold_ratio": "0.9", "tuning.schedule": "0 4 * * *"},
        )
        result = asyncio.run(reloader.reload())
    # The rules apply at once; tuning's schedule, as an edit of the file would, at a restart.
    assert (result.applied, result.needs_restart) == (("rules",), ("tuning",))
    assert loop.rules[-1].kv_saturation.usage_threshold_ratio == 0.9
    assert settings.from_deployment == {
        "rules.kv_saturation.usage_threshold_ratio": "0.9",
        "tuning.schedule": "0 4 * * *",
    }


@pytest.mark.slow
def test_the_running_sidecar_shows_and_reloads_its_deployments_settings(
    fake: FakeKubernetesApi, standin: StandInVllm, tmp_path: Path
) -> None:
    """`kvpilot run` on the pod runtime (in-process, a stand-in vLLM): the settings taken at
    start-up are in `/api/v1/status`; `kubectl annotate` and `POST /-/reload` apply more."""
    fake.add_deployment(base_deployment(standin.port))
    meta = fake.deployments[(NAMESPACE, "vllm")].obj["metadata"]
    meta["annotations"]["kvpilot.dev/rules.kv_saturation.for_s"] = "45"
    port = free_port()
    data = {
        "listen": {"host": "127.0.0.1", "port": port},
        "api": {"token": "t0ken"},
        "interval_s": 0.2,
        "state_dir": str(tmp_path / "state"),
        "runtime": {
            "kind": "pod",
            "port": standin.port,
            "kubernetes": {"namespace": NAMESPACE, "deployment": "vllm", "api_url": fake.host},
        },
    }
    config = validate_config(data, {}, warn=False)
    url = f"http://127.0.0.1:{port}"

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        stop = asyncio.Event()
        ticked: list[object] = []
        agent = asyncio.create_task(
            run_sidecar(
                config,
                stop=stop,
                on_tick=ticked.append,
                reload_config=lambda: validate_config(data, {}, warn=False),
            )
        )
        try:
            deadline = time.monotonic() + 30
            while not ticked:
                assert time.monotonic() < deadline, "no first tick within 30 s"
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                before = (await http.get("/api/v1/status")).json()
                meta["annotations"]["kvpilot.dev/tuning.trials"] = "4"
                reloaded = await http.post("/-/reload", headers={"authorization": "Bearer t0ken"})
                after = (await http.get("/api/v1/status")).json()
            return before, reloaded.json(), after
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(agent, timeout=30)

    before, reloaded, after = asyncio.run(main())
    assert before["settings_from_deployment"] == {"rules.kv_saturation.for_s": "45"}
    assert reloaded == {"applied": [], "needs_restart": ["tuning"]}
    assert after["settings_from_deployment"] == {
        "rules.kv_saturation.for_s": "45",
        "tuning.trials": "4",
    }
