"""The pod runtime reads the kubelet's `OOMKilled` from the vLLM container's status (on the
fake API server: no API server runs here), and the OOM guard classifies it as too big."""

from __future__ import annotations

from pathlib import Path

from kvpilot.agent.app.parts import build_runtime
from kvpilot.agent.runtimes.kubernetes.pod import PodRuntime
from kvpilot.tuner.oom import ExitFacts, OomSource, OomVerdict, classify_exit
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.k8s.test_pod_runtime import pod_config


def test_the_kubelets_oomkilled_is_read_from_the_container_status(fake, tmp_path: Path) -> None:
    fake.add_deployment(base_deployment(8000))
    runtime = build_runtime(pod_config(tmp_path, namespace=NAMESPACE, api_url=fake.host))
    assert isinstance(runtime, PodRuntime)
    assert runtime.termination_reason("llm") is None  # running, never terminated
    pod = fake.deployments[(NAMESPACE, "vllm")].pods[0]
    (status,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == "vllm"]
    status["lastState"] = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    reason = runtime.termination_reason("llm")
    assert reason == "OOMKilled"
    verdict = classify_exit(ExitFacts(container_reason=reason))
    assert isinstance(verdict, OomVerdict) and verdict.source is OomSource.KUBELET
