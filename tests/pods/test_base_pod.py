"""deploy/base as kustomize renders it, played as a real pod: a real CPU vLLM with the kvpool
plugin delivered by the init container, kvpilot beside it from the image the Dockerfile
builds, the securityContext as shipped (non-root, read-only root, every capability dropped).

kvpilot finds vLLM through the shared PID namespace, scrapes it and the plugin, fires
VllmPreemptionSpike under a burst, delivers the signed webhook to a receiver outside the pod,
restarts vLLM by signal and sees it serve again. The changes a pod here needs are listed in
`tests/pods/manifests.py` (CHANGES) and nothing else differs.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agent.notify.notify_receiver import Receiver
from tests.agent.sidecar_harness import burst_in_background, wait_for
from tests.pods import manifests
from tests.pods.images import Images
from tests.pods.podman import ROOT, PlayedPod, inspect, played

pytestmark = pytest.mark.slow

SECRET = "pod-webhook-secret"
# 64 blocks of 32 tokens (63 usable): 48 requests of ~300 tokens at once preempt heavily.
PREEMPTING_KV_BYTES = 64 * 32 * 1024


@dataclass
class BasePod:
    pod: PlayedPod
    ports: manifests.PodPorts
    receiver: Receiver
    marker: str

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.api}"

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.api_url}/api/v1/status", timeout=5).json()

    def main_pid(self) -> int | None:
        return self.status()["targets"][0]["main_pid"]

    def metrics(self) -> str:
        return httpx.get(f"{self.metrics_url}/metrics", timeout=5).text


def _pod_here(config: dict[str, Any], receiver: Receiver) -> None:
    config["rules"] = {
        "preemption_spike": {
            "action": "restart",
            "for_s": 0,
            "window_s": 10,
            "baseline_window_s": 60,
            "floor_per_s": 0.2,
            "baseline_multiple": 2,
        },
        "fragmentation": {"kv_blocks": {"enabled": False}},
        "kv_saturation": {"enabled": False},
        "engine_stall": {"enabled": False},
    }
    config["notifiers"] = [
        {"kind": "webhook", "url": f"{receiver.url}/hook", "hmac_secret": SECRET}
    ]
    config["remediation"] = {
        "cooldown_s": 0,
        "drain_timeout_s": 10,
        "verify_timeout_s": 300,
        "budget": {"max_restarts": 3, "window_s": 3600},
    }


@pytest.fixture(scope="module")
def base_pod(images: Images, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BasePod]:
    tmp = Path(tmp_path_factory.mktemp("base-pod"))
    ports = manifests.PodPorts()
    receiver = Receiver(secret=SECRET).start()
    name = manifests.unique_name("kvpilot-base")
    here = manifests.pod_here(
        manifests.rendered("base"),
        name,
        kvpilot_image=images.kvpilot,
        base_image=images.base,
        ports=ports,
        kv_bytes=PREEMPTING_KV_BYTES,
        edit=lambda c: _pod_here(c, receiver),
    )
    try:
        with played(here, tmp, name, uid=1000) as pod:  # the base's UID, as shipped
            yield BasePod(pod, ports, receiver, name)
    finally:
        receiver.stop()


def test_kvpilot_has_no_writable_tmp_and_runs_as_shipped(base_pod: BasePod) -> None:
    """As in Kubernetes: the read-only root gives kvpilot's container no /tmp at all."""
    probe = base_pod.pod.exec("kvpilot", "python3", "-c", "import tempfile; tempfile.mkdtemp()")
    assert probe.returncode != 0 and "No usable temporary directory" in probe.stderr
    who = base_pod.pod.exec("kvpilot", "python3", "-c", "import os; print(os.getuid())")
    assert who.stdout.strip() == "1000"
    caps = base_pod.pod.exec("kvpilot", "grep", "^CapEff", "/proc/self/status")
    assert caps.stdout.split()[-1] == "0000000000000000"  # every capability dropped
    wait_for(
        "kvpilot's /healthz",
        lambda: _get(f"{base_pod.metrics_url}/healthz") == 200,
        120,
    )


def test_the_image_carries_its_version_revision_and_source(images: Images) -> None:
    labels = inspect("image", images.kvpilot)["Labels"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert labels["org.opencontainers.image.version"] == version
    assert len(labels["org.opencontainers.image.revision"]) == 40  # the commit it was built at
    assert labels["org.opencontainers.image.source"].startswith("https://")
    # What a registry shows: home, the docs of this version's tag, when and from what.
    assert labels["org.opencontainers.image.url"] == labels["org.opencontainers.image.source"]
    assert labels["org.opencontainers.image.documentation"] == (
        f"{labels['org.opencontainers.image.source']}/blob/v{version}/docs/deploy.md"
    )
    created = datetime.fromisoformat(labels["org.opencontainers.image.created"])
    assert created.tzinfo is not None and created <= datetime.now(UTC)
    assert labels["org.opencontainers.image.base.name"] == images.base  # PYTHON_IMAGE here
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"


def test_the_plugin_comes_from_the_init_container(base_pod: BasePod) -> None:
    found = base_pod.pod.exec(
        "vllm",
        "sh",
        "-c",
        'PYTHONPATH=/opt/kvpilot-plugin "$0" -c "import kvpilot.collectors.kvpool.plugin as p; '
        'print(p.__file__)"',
        str(Path(manifests.sys.prefix) / "bin" / "python"),
    )
    assert found.stdout.strip().startswith("/opt/kvpilot-plugin/"), found.stdout + found.stderr


def test_kvpilot_finds_and_scrapes_vllm_and_its_plugin(base_pod: BasePod) -> None:
    def scraping() -> bool:
        lines = base_pod.metrics().splitlines()
        return all(
            f'kvpilot_collector_up{{role="stable",server="vllm",source="{s}"}} 1.0' in lines
            for s in ("vllm", "kvpool")
        )

    wait_for("kvpilot scraping vLLM and the kvpool plugin", scraping, 420)
    assert base_pod.main_pid() is not None  # found through the shared PID namespace


def test_the_control_api_answers_on_its_own_port_only(base_pod: BasePod) -> None:
    assert _get(f"{base_pod.metrics_url}/api/v1/status") == 404
    assert _get(f"{base_pod.api_url}/api/v1/status") == 200
    assert _get(f"{base_pod.api_url}/metrics") == 200


def test_a_burst_fires_notifies_and_restarts_vllm_by_signal(base_pod: BasePod) -> None:
    first_pid = base_pod.main_pid()
    assert first_pid is not None
    restarts_before = base_pod.pod.restart_count("vllm")
    load, reports = burst_in_background(f"http://127.0.0.1:{base_pod.ports.vllm}", base_pod.marker)

    firing = wait_for(
        "a signed PreemptionSpike notification at the receiver outside the pod",
        lambda: _notified(base_pod.receiver, "VllmPreemptionSpike", "firing"),
        240,
    )
    assert firing.signature_ok is True
    restarted = wait_for(
        "a restart that succeeded",
        lambda: [
            r
            for r in base_pod.status()["last_actions"]
            if r["action"] == "restart" and r["state"] == "succeeded"
        ],
        420,
    )
    assert restarted[0]["old_pid"] == first_pid
    # The signal ended vLLM's container and podman, as the kubelet does, restarted it.
    assert base_pod.pod.restart_count("vllm") > restarts_before
    assert base_pod.main_pid() not in (None, first_pid)
    # The restarted vLLM serves. A second spike incident raised during the drain is skipped
    # as superseded, but one the restarted server still shows is carried out (this pod's
    # cooldown is 0 s) and cuts a request off ("Server disconnected"), while the burst goes
    # on. So the request is tried until one answers.
    answer = wait_for(
        "a completion from the restarted vLLM",
        lambda: _completion(base_pod.ports.vllm, base_pod.marker),
        180,
    )
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    load.join(timeout=300)
    assert reports and len(reports[0].ok) > 0  # the burst really reached the server


def _completion(port: int, model: str) -> httpx.Response | None:
    """A completion's answer when it is 200; a refused or cut-off request raises, and
    `wait_for` keeps the error for its message."""
    answer = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": model, "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True},
        timeout=60,
    )
    return answer if answer.status_code == 200 else None


def _get(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def _notified(receiver: Receiver, alertname: str, status: str) -> Any:
    for request in receiver.accepted():
        for alert in request.json().get("alerts", []):
            if (
                alert["labels"].get("alertname", "").endswith(alertname)
                and alert["status"] == status
            ):
                return request
    return None
