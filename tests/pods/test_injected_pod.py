"""deploy/components/sidecar put into a Deployment shaped like vLLM production-stack's
(tests/pods/production_stack/) by deploy/helm's post-renderer, as `helm install
--post-renderer` runs it (tests/dashboards/test_helm_post_renderer.py checks it statically,
and that kustomize gives the same documents), played as a real pod with a real CPU vLLM that
runs as root, as the chart runs it.

kvpilot runs at vLLM's UID, 0, with every capability dropped (the choice docs/deploy.md
explains): it finds vLLM through the shared PID namespace, scrapes it and the plugin the
init container delivered, and restarts it by signal when asked through its control API.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agent.sidecar_harness import wait_for
from tests.dashboards.test_helm_post_renderer import (
    CHART_OUTPUT,
    CHART_PYTHONPATH,
    KVPILOT_UID,
)
from tests.pods import manifests
from tests.pods.images import Images
from tests.pods.podman import PlayedPod, played

pytestmark = pytest.mark.slow

TOKEN = "pod-control-token"


@dataclass
class InjectedPod:
    pod: PlayedPod
    ports: manifests.PodPorts

    def get(self, path: str) -> Any:
        return httpx.get(f"http://127.0.0.1:{self.ports.api}{path}", timeout=5).json()

    def main_pid(self) -> int | None:
        return self.get("/api/v1/status")["targets"][0]["main_pid"]


def _control_token(config: dict[str, Any]) -> None:
    config["api"]["token"] = TOKEN
    config["remediation"] = {"cooldown_s": 0, "drain_timeout_s": 10, "verify_timeout_s": 300}


@pytest.fixture(scope="module")
def injected(images: Images, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InjectedPod]:
    tmp = Path(tmp_path_factory.mktemp("injected-pod"))
    ports = manifests.PodPorts()
    name = manifests.unique_name("vllm-tiny")
    here = manifests.pod_here(
        manifests.post_rendered_chart(CHART_OUTPUT, KVPILOT_UID),
        name,
        kvpilot_image=images.kvpilot,
        base_image=images.base,
        ports=ports,
        kv_bytes=64 * 1024 * 1024,
        edit=_control_token,
    )
    with played(here, tmp, name, uid=0) as pod:  # the chart's vLLM runs as root
        yield InjectedPod(pod, ports)


def test_kvpilot_at_vllms_uid_finds_scrapes_and_restarts_it(injected: InjectedPod) -> None:
    who = injected.pod.exec("kvpilot", "grep", "-E", "^(Uid|CapEff)", "/proc/self/status")
    fields = dict(line.split(":", 1) for line in who.stdout.splitlines())
    assert fields["Uid"].split()[0] == "0"
    assert fields["CapEff"].strip() == "0000000000000000"  # root without a capability

    def scraping() -> bool:
        lines = httpx.get(f"http://127.0.0.1:{injected.ports.metrics}/metrics", timeout=5).text
        return all(
            f'kvpilot_collector_up{{role="stable",server="vllm",source="{s}"}} 1.0'
            in lines.splitlines()
            for s in ("vllm", "kvpool")
        )

    wait_for("kvpilot scraping the root vLLM and its plugin", scraping, 420)
    first_pid = injected.main_pid()
    assert first_pid is not None
    # The running vLLM's PYTHONPATH: the plugin's folder in front of the chart's own. Read
    # from vLLM's own container: kvpilot's, root without a capability, may not read another
    # process's environment (the kernel asks for ptrace access), and needs not.
    environ = injected.pod.exec("vllm", "cat", f"/proc/{first_pid}/environ")
    assert environ.returncode == 0, environ.stderr
    (python_path,) = [
        v.removeprefix("PYTHONPATH=")
        for v in environ.stdout.split("\0")
        if v.startswith("PYTHONPATH=")
    ]
    assert python_path.split(":")[:2] == ["/opt/kvpilot-plugin", CHART_PYTHONPATH]
    answer = httpx.post(
        f"http://127.0.0.1:{injected.ports.api}/api/v1/remediations",
        json={"instance": "vllm", "requested_by": "test", "reason": "a restart by hand"},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert answer.status_code == 202, answer.text
    restarted = wait_for(
        "the restart asked for through the control API",
        lambda: [
            r
            for r in injected.get("/api/v1/status")["last_actions"]
            if r["action"] == "restart" and r["state"] == "succeeded"
        ],
        420,
    )
    assert restarted[0]["old_pid"] == first_pid
    assert injected.main_pid() not in (None, first_pid)
