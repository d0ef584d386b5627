"""deploy/overlays/tuning as kustomize renders it, played as a real pod from the image the
Dockerfile builds: kvpilot with `runtime.kind: pod`, its tuning schedule and its state
claim, starts and becomes ready beside a stand-in vLLM process, against the fake Kubernetes
API server (tests/fakes/k8s_apiserver.py: no real API server can run here).

The image holds what the overlay needs (the Kubernetes client, the tuner's scientific
stack): kvpilot reads the Deployment through the API, holds nothing back for a missing extra,
and schedules its tuning.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agent.sidecar_harness import wait_for
from tests.fakes.k8s_apiserver import FakeKubernetesApi
from tests.fakes.standin_vllm_module import install
from tests.pods import manifests
from tests.pods.images import Images
from tests.pods.podman import PlayedPod, played

pytestmark = pytest.mark.slow


@dataclass
class TuningPod:
    pod: PlayedPod
    ports: manifests.PodPorts
    fake: FakeKubernetesApi


def _standin(
    deployment: dict[str, Any], command: list[str], ports: manifests.PodPorts, root: Path, tag: str
) -> None:
    """vLLM's container with its command as rendered (`python3 -m vllm.entrypoints...`, the
    base image's Debian Python), running the stand-in server from `root` on loopback."""
    vllm = manifests.container(deployment, "vllm")
    vllm["command"] = command
    vllm["args"] = ["--model=stand-in", "--host=127.0.0.1", f"--port={ports.vllm}"]
    shipped = {e["name"]: e.get("value") for e in vllm["env"]}["PYTHONPATH"]
    for var, value in {
        "PYTHONPATH": f"{root}:{shipped}",
        "STANDIN_PLAN": "serve",
        "STANDIN_STARTS": "/cache/standin-starts",
        "STANDIN_TAG": tag,
    }.items():
        manifests.set_env(vllm, var, value)
    spec = manifests.pod_spec(deployment)
    spec["volumes"].append(
        {"name": "standin", "hostPath": {"path": str(root), "type": "Directory"}}
    )
    vllm["volumeMounts"].append({"name": "standin", "mountPath": str(root), "readOnly": True})


@pytest.fixture(scope="module")
def tuning_pod(images: Images, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TuningPod]:
    tmp = Path(tmp_path_factory.mktemp("tuning-pod"))
    root = install(tmp / "standin")
    ports = manifests.PodPorts()
    name = manifests.unique_name("kvpilot-tuning")
    docs = manifests.rendered("tuning")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    command = list(manifests.container(deployment, "vllm")["command"])
    with FakeKubernetesApi() as fake:
        # The API's view: the overlay's Deployment as rendered, in the pod's namespace.
        seeded = copy.deepcopy(deployment)
        seeded["metadata"]["namespace"] = "default"
        fake.add_deployment(seeded)
        here = manifests.pod_here(
            docs,
            name,
            kvpilot_image=images.kvpilot,
            base_image=images.base,
            ports=ports,
            kv_bytes=64 * 1024 * 1024,
            edit=lambda config: None,
        )
        (played_deployment,) = [d for d in here.docs if d["kind"] == "Deployment"]
        _standin(played_deployment, command, ports, root, name)
        kvpilot = manifests.container(played_deployment, "kvpilot")
        manifests.set_env(kvpilot, "KVPILOT_RUNTIME__KUBERNETES__API_URL", fake.host)
        with played(here, tmp, name, uid=1000) as pod:
            yield TuningPod(pod, ports, fake)


def test_the_tuning_overlay_starts_and_is_ready_on_its_own_image(tuning_pod: TuningPod) -> None:
    metrics = f"http://127.0.0.1:{tuning_pod.ports.metrics}"
    wait_for("kvpilot's /healthz", lambda: _get(f"{metrics}/healthz") == 200, 180)

    def reads_its_deployment() -> bool:
        return any(
            r.method == "GET" and r.path.endswith("/deployments/vllm")
            for r in tuning_pod.fake.requests
        )

    wait_for("kvpilot reading its Deployment through the API", reads_its_deployment, 120)
    status = httpx.get(f"http://127.0.0.1:{tuning_pod.ports.api}/api/v1/status", timeout=5)
    assert status.status_code == 200
    assert status.json()["targets"][0]["main_pid"] is not None  # the stand-in, in the pod
    log = tuning_pod.pod.logs("kvpilot")
    assert "Traceback" not in log and "pip install" not in log, log[-3000:]


def _get(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None
