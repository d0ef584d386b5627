"""`runtime.kind: pod` builds the Kubernetes runtime over the process runtime, pointed at the
fake API server (a fake: no API server runs here) through `kubernetes.api_url`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvpilot.agent.app.parts import build_pod_runtime, build_runtime
from kvpilot.agent.config import PodRuntimeConfig, validate_config
from kvpilot.agent.runtimes import ProcessRuntime, RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.api import pod_name, pod_namespace
from kvpilot.agent.runtimes.kubernetes.pod import PodRuntime, strict_reads
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from tests.agent.k8s.conftest import NAMESPACE, base_deployment


def pod_config(tmp_path: Path, **kubernetes: object):
    return validate_config(
        {
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "pod",
                "name": "llm",
                "host": "127.0.0.1",
                "port": 8000,
                "kvpool_port": 9500,
                "api_key": "sk-test",
                "kubernetes": {"deployment": "vllm", "promote": "apply", **kubernetes},
            },
        },
        warn=False,
    )


def test_the_pod_runtime_reaches_the_deployment_and_signals_by_process(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    config = pod_config(tmp_path, namespace=NAMESPACE, api_url=fake.host + "/")

    runtime = build_runtime(config)

    assert isinstance(runtime, KubernetesRuntime)
    target = runtime.target
    assert (target.namespace, target.deployment, target.container) == (NAMESPACE, "vllm", "vllm")
    assert (target.stable_name, target.stable_url, target.promote) == (
        "llm",
        "http://127.0.0.1:8000",
        "apply",
    )
    assert target.api_key == "sk-test" and target.state_dir == tmp_path / "state"
    assert isinstance(runtime._process, ProcessRuntime)  # restarts stay signals
    (stable,) = runtime.instances()  # read through the API server
    assert stable.name == "llm" and stable.role == "stable"
    assert stable.argv is not None and "--model=Qwen/Qwen2.5-1.5B-Instruct" in stable.argv
    assert stable.kvpool_url == "http://127.0.0.1:9500"


def test_the_namespace_and_identity_come_from_the_pod(fake, tmp_path) -> None:
    config = pod_config(tmp_path, api_url=fake.host)
    assert isinstance(config.runtime, PodRuntimeConfig)
    environ = {"POD_NAMESPACE": "team-a", "POD_NAME": "vllm-7c9d-x2"}

    runtime = build_pod_runtime(config, config.runtime, environ)

    assert runtime.target.namespace == "team-a"
    assert runtime.lease.identity == "vllm-7c9d-x2" and runtime.lease.namespace == "team-a"


def test_the_service_account_file_names_the_namespace(tmp_path) -> None:
    (tmp_path / "namespace").write_text("serving\n")
    assert pod_namespace({}, tmp_path) == "serving"
    assert pod_namespace({"KVPILOT_POD_NAMESPACE": "other"}, tmp_path) == "other"
    assert pod_name({"HOSTNAME": "vllm-abc"}) == "vllm-abc"
    with pytest.raises(
        RuntimeFailure, match=r"set runtime\.kubernetes\.namespace, or POD_NAMESPACE"
    ):
        pod_namespace({}, tmp_path / "absent")


def test_outside_a_cluster_without_api_url_says_what_to_set(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = pod_config(tmp_path, namespace=NAMESPACE)
    with pytest.raises(RuntimeFailure, match=r"set runtime\.kubernetes\.api_url"):
        build_runtime(config)


def test_while_the_api_server_fails_the_stable_comes_from_the_pods_processes(
    fake, tmp_path, caplog
) -> None:
    fake.add_deployment(base_deployment(8000))
    runtime = build_runtime(pod_config(tmp_path, namespace=NAMESPACE, api_url=fake.host))
    assert isinstance(runtime, PodRuntime)
    now = [1000.0]
    runtime._clock = lambda: now[0]
    fake.fail("GET", r"/deployments/vllm$", 500, times=2)

    first = runtime.instances()  # the tick goes on
    gets = len(fake.requests)
    second = runtime.instances()  # within the read interval: not tried again
    assert len(fake.requests) == gets
    now[0] += runtime.api_read_interval_s
    third = runtime.instances()  # tried again, failing still

    for found in (first, second, third):
        (stable,) = found
        assert (stable.name, stable.role, stable.url) == ("llm", "stable", "http://127.0.0.1:8000")
        assert stable.argv is None  # no vLLM process in this test's /proc
    assert runtime.api_failures_total == 2
    assert sum("the API server failed" in r.message for r in caplog.records) == 1  # once
    now[0] += runtime.api_read_interval_s
    (stable,) = runtime.instances()  # answering again: the Deployment's view
    assert stable.argv is not None and "--model=Qwen/Qwen2.5-1.5B-Instruct" in stable.argv


def test_the_tuners_reads_never_fall_back(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    runtime = build_runtime(pod_config(tmp_path, namespace=NAMESPACE, api_url=fake.host))
    fake.fail("GET", r"/deployments/vllm$", 500)

    with strict_reads(), pytest.raises(RuntimeFailure, match="HTTP 500"):
        runtime.instances()

    assert runtime.api_failures_total == 0


def test_ticks_reuse_the_api_view_and_strict_reads_and_changes_do_not(fake, tmp_path) -> None:
    """A tick each second must not read the API server each second (a fleet would flood it)."""
    fake.add_deployment(base_deployment(8000))
    config = pod_config(tmp_path, namespace=NAMESPACE, api_url=fake.host)
    assert isinstance(config.runtime, PodRuntimeConfig)
    now = [1000.0]
    runtime = build_pod_runtime(config, config.runtime, {})
    runtime._clock = lambda: now[0]

    def gets() -> int:
        return sum(1 for r in fake.requests if r.method == "GET")

    first = runtime.instances()
    after_first = gets()
    for _ in range(30):  # thirty ticks within the read interval: no API read
        now[0] += 0.4
        assert runtime.instances() == first
    assert gets() == after_first and runtime.api_reads_total == 1
    with strict_reads():  # the tuner's reads always go to the API server
        runtime.instances()
    assert gets() > after_first
    now[0] += runtime.api_read_interval_s  # the interval has passed: read again
    before = gets()
    runtime.instances()
    assert gets() > before and runtime.api_reads_total == 3
    # A change (here stopping a canary that is not there) drops the view.
    stopped = asyncio.run(runtime.stop("vllm-kvpilot-canary", drain_timeout_s=0))
    assert not stopped.was_running
    before = gets()
    runtime.instances()
    assert gets() > before
