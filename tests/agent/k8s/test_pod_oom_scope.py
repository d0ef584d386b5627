"""The OOM guard's reading of the kubelet's termination reason covers the pods it manages:
this pod for the stable (not another replica's old OOMKilled), and a Deployment's pods by
its whole selector (matchExpressions too, never every pod in the namespace). Against the
fake API server (a fake: no API server runs here)."""

from __future__ import annotations

import copy

from kvpilot.agent.app.parts import build_pod_runtime
from kvpilot.agent.config import PodRuntimeConfig
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.k8s.test_pod_runtime import pod_config


def oom_killed(pod: dict, name: str) -> dict:
    """`pod` renamed, its vLLM container's last termination OOMKilled."""
    out = copy.deepcopy(pod)
    out["metadata"]["name"] = name
    for status in out["status"]["containerStatuses"]:
        status["lastState"] = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    return out


def runtime_of(fake, tmp_path, environ: dict[str, str]):
    config = pod_config(tmp_path, namespace=NAMESPACE, api_url=fake.host)
    assert isinstance(config.runtime, PodRuntimeConfig)
    return build_pod_runtime(config, config.runtime, environ)


def test_another_replicas_old_oom_kill_is_not_this_pods(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    pods = fake.deployments[(NAMESPACE, "vllm")].pods
    (mine,) = pods
    pods.append(oom_killed(mine, "vllm-other-replica"))
    runtime = runtime_of(fake, tmp_path, {"POD_NAME": mine["metadata"]["name"]})

    assert runtime.termination_reason("llm") is None

    pods[0] = oom_killed(mine, mine["metadata"]["name"])  # now this pod's vLLM was killed
    assert runtime.termination_reason("llm") == "OOMKilled"


def test_a_selector_of_match_expressions_reads_only_the_deployments_pods(fake, tmp_path) -> None:
    body = base_deployment(8000)
    labels = body["spec"]["selector"].pop("matchLabels")
    body["spec"]["selector"]["matchExpressions"] = [
        {"key": k, "operator": "In", "values": [v]} for k, v in labels.items()
    ]
    fake.add_deployment(body)
    other = base_deployment(8000)
    other["metadata"]["name"] = "other-model"
    other["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "other-model"
    other["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] = "other-model"
    fake.add_deployment(other)
    entry = fake.deployments[(NAMESPACE, "other-model")]
    entry.pods = [oom_killed(p, p["metadata"]["name"]) for p in entry.pods]
    runtime = runtime_of(fake, tmp_path, {})  # no pod name: the Deployment's pods

    assert runtime.termination_reason("llm") is None  # other-model's pods are not read

    mine = fake.deployments[(NAMESPACE, "vllm")]
    mine.pods = [oom_killed(p, p["metadata"]["name"]) for p in mine.pods]
    assert runtime.termination_reason("llm") == "OOMKilled"  # its own pods are
