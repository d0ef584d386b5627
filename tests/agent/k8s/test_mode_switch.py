"""The live switch read from Kubernetes: the Deployment's annotation over the namespace's
ConfigMap over the configuration, through the real client against the fake API server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvpilot.agent.mode import LiveMode, Mode, ModeSource
from kvpilot.agent.runtimes.kubernetes.switch import (
    SWITCH_INTERVAL_S,
    SwitchWatch,
    apply_layers,
    read_layers,
)
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.fakes.k8s_configmaps import FakeApiWithConfigMaps


@pytest.fixture
def api() -> Iterator[FakeApiWithConfigMaps]:
    with FakeApiWithConfigMaps() as fake:
        fake.add_deployment(base_deployment(8000))
        yield fake


def _annotate(api: FakeApiWithConfigMaps, value: str | None) -> None:
    """`kubectl annotate deployment vllm kvpilot.dev/mode=VALUE` (None: `kvpilot.dev/mode-`)."""
    annotations = api.deployments[(NAMESPACE, "vllm")].obj["metadata"].setdefault("annotations", {})
    if value is None:
        annotations.pop("kvpilot.dev/mode", None)
    else:
        annotations["kvpilot.dev/mode"] = value


def _namespace_mode(api: FakeApiWithConfigMaps, value: str | None) -> None:
    if value is None:
        api.config_maps.pop((NAMESPACE, "kvpilot-mode"), None)
        return
    api.config_maps[(NAMESPACE, "kvpilot-mode")] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "kvpilot-mode", "namespace": NAMESPACE, "resourceVersion": "1"},
        "data": {"mode": value},
    }


def _watch(api: FakeApiWithConfigMaps, live: LiveMode) -> SwitchWatch:
    client = api.api_client()
    return SwitchWatch(
        live,
        lambda both: read_layers(client, NAMESPACE, "vllm", namespace_too=both),
        namespace_every=1,
    )


def test_the_annotation_wins_over_the_configmap_over_the_file(api) -> None:
    live = LiveMode(Mode.ARMED)
    watch = _watch(api, live)

    asyncio.run(watch.once())
    assert (live.current().mode, live.current().source) == (Mode.ARMED, ModeSource.CONFIG)

    _namespace_mode(api, "dry-run")
    asyncio.run(watch.once())
    assert (live.current().mode, live.current().source) == (Mode.DRY_RUN, ModeSource.NAMESPACE)

    _annotate(api, "Paused ")  # case and blanks as people type them
    asyncio.run(watch.once())
    assert (live.current().mode, live.current().source) == (Mode.PAUSED, ModeSource.DEPLOYMENT)

    _annotate(api, None)
    _namespace_mode(api, None)
    asyncio.run(watch.once())
    assert live.current().source is ModeSource.CONFIG


def test_a_failed_read_keeps_the_last_word_and_a_typo_pauses(api) -> None:
    live = LiveMode(Mode.ARMED)
    watch = _watch(api, live)
    _namespace_mode(api, "dry-run")
    asyncio.run(watch.once())

    api.fail("GET", r"/configmaps/kvpilot-mode$", 503, times=1)
    asyncio.run(watch.once())
    assert live.current().mode is Mode.DRY_RUN  # the API server away: no order to arm

    _namespace_mode(api, "armd")
    asyncio.run(watch.once())
    assert live.current().mode is Mode.PAUSED
    assert "not a mode" in live.current().detail


def test_the_deployment_is_read_every_ten_seconds_and_the_namespace_every_thirty(api) -> None:
    """About 0.13 requests a second (under the fleet's 0.2, with room for its own reads); the
    annotation applies within 10 s, the namespace's ConfigMap within 30 s."""
    client = api.api_client()
    live = LiveMode(Mode.ARMED)
    watch = SwitchWatch(
        live, lambda both: read_layers(client, NAMESPACE, "vllm", namespace_too=both)
    )
    _namespace_mode(api, "dry-run")
    api.requests.clear()
    for _ in range(6):
        asyncio.run(watch.once())
    read = [r.path.rsplit("/", 2)[-2] for r in api.requests]
    assert read.count("deployments") == 6 and read.count("configmaps") == 2
    assert watch.interval_s == SWITCH_INTERVAL_S <= 10.0
    assert len(api.requests) / (6 * watch.interval_s) <= 0.14
    # A read without the ConfigMap leaves the namespace's layer as it was.
    assert live.current().mode is Mode.DRY_RUN
    _annotate(api, "paused")
    asyncio.run(watch.once())  # the 7th read: the Deployment only, applied at once
    assert live.current().source is ModeSource.DEPLOYMENT


def test_an_unreadable_layer_is_left_alone() -> None:
    from kvpilot.agent.runtimes.kubernetes.switch import KEEP, Layer

    live = LiveMode(Mode.ARMED)
    apply_layers(live, Layer(Mode.PAUSED, "d"), Layer(Mode.DRY_RUN, "n"))
    apply_layers(live, KEEP, Layer(None, "n"))
    assert live.current().mode is Mode.PAUSED and len(live.layers()) == 2
