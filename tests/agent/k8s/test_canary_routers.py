"""A canary's pods are not picked by the routers that select vLLM pods by label, unless live
traffic asks for it; the selectors are the routers' own (tests/fixtures/routers/README.md)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvpilot.agent.runtimes.kubernetes.objects import (
    ROLE_LABEL,
    ContainerCommand,
    build_canary,
    canary_pod_selector,
)

ROUTERS = Path(__file__).parents[2] / "fixtures" / "routers"
COMMAND = ContainerCommand(None, ("--model=candidate",))


def _fixture(name: str) -> dict[str, Any]:
    loaded = yaml.safe_load((ROUTERS / name).read_text())
    assert isinstance(loaded, dict)
    return loaded


def _selects(selector: str, labels: Mapping[str, str]) -> bool:
    """Whether a `--k8s-label-selector` of `key=value` terms (the chart's form) selects."""
    terms = [term.split("=", 1) for term in selector.split(",") if term]
    return all(labels.get(key) == value for key, value in terms)


def _matches(match_labels: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in match_labels.items())


def _pod_labels(canary: Mapping[str, Any]) -> dict[str, str]:
    return dict(canary["spec"]["template"]["metadata"]["labels"])


def _router_selector(args: list[str]) -> str:
    return args[args.index("--k8s-label-selector") + 1]


def test_production_stacks_router_does_not_pick_a_replayed_canary() -> None:
    chart = _fixture("production_stack.yaml")
    selector = _router_selector(chart["router_args"])
    stable = chart["deployment"]
    assert _selects(selector, stable["spec"]["template"]["metadata"]["labels"])  # the premise

    canary = build_canary(stable, container="vllm", command=COMMAND, sidecar_container=None)

    assert not _selects(selector, _pod_labels(canary))
    assert not _matches(chart["engine_service_selector"], _pod_labels(canary))


def test_production_stacks_router_picks_a_canary_sharing_live_traffic() -> None:
    """traffic: service gives the canary the engine Service's selector: the router, which
    selects on a part of it, then sends the canary its share too."""
    chart = _fixture("production_stack.yaml")
    canary = build_canary(
        chart["deployment"],
        container="vllm",
        command=COMMAND,
        sidecar_container=None,
        serve_labels=chart["engine_service_selector"],
    )

    assert _selects(_router_selector(chart["router_args"]), _pod_labels(canary))
    # Its own ReplicaSet still selects on kvpilot's labels only, which the pull-back keeps.
    assert canary["spec"]["selector"]["matchLabels"] == canary_pod_selector(
        "vllm-llama3-deployment-vllm"
    )


def test_an_inference_pool_does_not_pick_a_replayed_canary() -> None:
    found = _fixture("inference_pool.yaml")
    pool = found["inference_pool"]["spec"]["selector"]["matchLabels"]
    stable = found["deployment"]
    assert _matches(pool, stable["spec"]["template"]["metadata"]["labels"])

    canary = build_canary(stable, container="echoserver", command=COMMAND, sidecar_container=None)
    assert not _matches(pool, _pod_labels(canary))

    live = build_canary(
        stable, container="echoserver", command=COMMAND, sidecar_container=None, serve_labels=pool
    )
    assert _matches(pool, _pod_labels(live))


def test_the_canary_selector_is_a_valid_label_for_any_deployment_name() -> None:
    long_name = "model-" + "x" * 200 + ".example"
    selector = canary_pod_selector(long_name)
    value = selector["kvpilot.dev/canary-of"]
    assert len(value) <= 63 and value[0].isalnum() and value[-1].isalnum()
    assert selector != canary_pod_selector(long_name + "2")  # still one per Deployment
    assert selector[ROLE_LABEL] == "canary"
