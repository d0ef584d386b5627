"""The fake API server seeded with the base Deployment, a stand-in vLLM, and the runtime."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime, KubernetesTarget
from tests.dashboards.kustomize_builds import build
from tests.fakes.k8s_apiserver import FakeKubernetesApi
from tests.fakes.standin_vllm import StandInVllm

NAMESPACE = "serving"


def base_deployment(port: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """deploy/base's Deployment as kustomize renders it (the sidecar in), its vLLM port moved
    to the stand-in's."""
    (rendered,) = [d for d in build("base") if d["kind"] == "Deployment"]
    body = copy.deepcopy(dict(rendered))
    body["metadata"]["namespace"] = NAMESPACE
    body["metadata"]["labels"].update(labels or {})
    vllm = body["spec"]["template"]["spec"]["containers"][0]
    vllm["args"] = [a if not a.startswith("--port=") else f"--port={port}" for a in vllm["args"]]
    return body


@pytest.fixture
def standin() -> Iterator[StandInVllm]:
    with StandInVllm() as server:
        yield server


@pytest.fixture
def fake() -> Iterator[FakeKubernetesApi]:
    with FakeKubernetesApi() as api:
        yield api


def make_runtime(
    fake: FakeKubernetesApi, port: int, tmp_path: Path, **target: Any
) -> KubernetesRuntime:
    settings: dict[str, Any] = dict(
        namespace=NAMESPACE,
        deployment="vllm",
        port=port,
        stable_url=f"http://127.0.0.1:{port}",
        state_dir=tmp_path,
    )
    settings.update(target)
    return KubernetesRuntime(
        KubernetesTarget(**settings), fake.api_client(), identity="pod-a", poll_s=0.01
    )
