"""The Kubernetes runtime against the fake API server and a stand-in vLLM."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from kvpilot.agent.runtimes.base import NotReady, RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.api import Forbidden
from kvpilot.agent.runtimes.kubernetes.objects import ROLE_LABEL
from kvpilot.agent.runtimes.kubernetes.runtime import PromotionNotApplied
from tests.agent.k8s.conftest import NAMESPACE, base_deployment, make_runtime

CANARY = "vllm-kvpilot-canary"


def candidate(port: int) -> list[str]:
    return [
        "--model=Qwen/Qwen2.5-1.5B-Instruct",
        "--host=0.0.0.0",
        f"--port={port}",
        "--gpu-memory-utilization=0.80",
        "--max-num-seqs=64",
    ]


def test_canary_created_from_the_stable_template_and_cleaned_up(fake, standin, tmp_path) -> None:
    stable = fake.add_deployment(base_deployment(standin.port))
    runtime = make_runtime(fake, standin.port, tmp_path)
    argv = candidate(standin.port)

    instance = asyncio.run(
        runtime.restart(CANARY, drain_timeout_s=5, ready_timeout_s=10, argv=argv)
    )

    assert instance.role == "canary"
    assert instance.url == f"http://127.0.0.1:{standin.port}"  # the pod IP
    assert instance.argv == ("python3", "-m", "vllm.entrypoints.openai.api_server", *argv)
    assert standin.completions_total >= 1  # probed, not only waited on
    canary = fake.deployment(NAMESPACE, CANARY)
    spec = canary["spec"]
    assert spec["replicas"] == 1
    assert spec["selector"]["matchLabels"][ROLE_LABEL] == "canary"
    assert spec["template"]["metadata"]["labels"][ROLE_LABEL] == "canary"
    containers = {c["name"]: c for c in spec["template"]["spec"]["containers"]}
    assert set(containers) == {"vllm"}  # the sidecar is not copied
    assert containers["vllm"]["args"] == argv
    stable_vllm = stable["spec"]["template"]["spec"]["containers"][0]
    assert containers["vllm"]["resources"] == stable_vllm["resources"]
    # vLLM's volumes come along; the sidecar's (its configuration, its state claim) do not.
    stable_volumes = stable["spec"]["template"]["spec"]["volumes"]
    mounted = {m["name"] for m in containers["vllm"].get("volumeMounts") or ()}
    assert spec["template"]["spec"]["volumes"] == [
        v for v in stable_volumes if v["name"] in mounted
    ]
    assert {"config", "state"} & mounted == set() and len(mounted) >= 2
    owner = canary["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "Deployment",
        "vllm",
        stable["metadata"]["uid"],
    )
    assert [i.role for i in runtime.instances()] == ["stable", "canary"]

    result = asyncio.run(runtime.stop(CANARY, drain_timeout_s=5))

    assert result.was_running
    assert fake.deployment(NAMESPACE, CANARY) is None
    assert fake.pods_of(NAMESPACE, CANARY) == []
    delete = fake.writes("DELETE")[0]
    assert delete.body["propagationPolicy"] == "Foreground"
    assert [i.role for i in runtime.instances()] == ["stable"]
    # The stable Deployment was never written to.
    assert not [r for r in fake.writes() if r.path.endswith("/deployments/vllm")]


def test_crashing_canary_reports_the_termination_message(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    fake.crash["canary"] = ("CrashLoopBackOff", "ValueError: No available memory for the cache")
    runtime = make_runtime(fake, standin.port, tmp_path)

    with pytest.raises(NotReady, match="CrashLoopBackOff") as caught:
        asyncio.run(runtime.start_canary(candidate(standin.port), ready_timeout_s=10))
    assert "No available memory for the cache" in (caught.value.log_tail or "")
    created = fake.writes("POST")[0].body
    vllm = created["spec"]["template"]["spec"]["containers"][0]
    assert vllm["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_promotion_patches_args_and_waits_for_the_rollout(fake, standin, tmp_path) -> None:
    fake.rollout_reads = 3
    fake.add_deployment(base_deployment(standin.port))
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")
    argv = candidate(standin.port)

    instance = asyncio.run(
        runtime.restart("vllm", drain_timeout_s=5, ready_timeout_s=10, argv=argv)
    )

    patch = fake.writes("PATCH")[0]
    assert patch.content_type == "application/strategic-merge-patch+json"
    assert patch.body["spec"]["template"]["spec"]["containers"] == [{"name": "vllm", "args": argv}]
    assert patch.body["metadata"]["resourceVersion"]  # optimistic concurrency
    after = fake.deployment(NAMESPACE, "vllm")
    containers = {c["name"]: c for c in after["spec"]["template"]["spec"]["containers"]}
    assert containers["vllm"]["args"] == argv
    assert containers["kvpilot"]["args"][0] == "run"  # merged by name, not replaced
    assert after["metadata"]["generation"] == 2
    assert after["status"]["observedGeneration"] == 2  # the runtime waited for it
    gets = [r for r in fake.requests if r.method == "GET" and r.path.endswith("/vllm")]
    assert len(gets) >= 1 + fake.rollout_reads  # read before the patch, then polled
    assert instance.argv[-len(argv) :] == tuple(argv)


def test_promotion_retries_a_conflict_on_the_new_version(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    fake.fail("PATCH", r"/deployments/vllm$", 409)
    runtime = make_runtime(fake, standin.port, tmp_path, promote="apply")

    asyncio.run(runtime.promote(candidate(standin.port), ready_timeout_s=10))

    assert len(fake.writes("PATCH")) == 2
    args = fake.deployment(NAMESPACE, "vllm")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == candidate(standin.port)


@pytest.mark.parametrize(
    ("labels", "mode"),
    [
        ({"argocd.argoproj.io/instance": "serving"}, "auto"),
        ({"app.kubernetes.io/managed-by": "flux"}, "auto"),
        ({}, "recommend"),
    ],
)
def test_recommend_only_writes_the_patch_and_never_patches(
    fake, standin, tmp_path, labels, mode
) -> None:
    fake.add_deployment(base_deployment(standin.port, labels))
    runtime = make_runtime(fake, standin.port, tmp_path, promote=mode)
    argv = candidate(standin.port)

    with pytest.raises(PromotionNotApplied, match="recommend-only") as caught:
        asyncio.run(runtime.restart("vllm", drain_timeout_s=5, ready_timeout_s=10, argv=argv))

    # Nothing changed on the Deployment: the one write is the Event that announces the patch.
    assert [(r.method, r.path) for r in fake.writes()] == [
        ("POST", f"/api/v1/namespaces/{NAMESPACE}/events")
    ]
    recommendation = caught.value.recommendation
    written = json.loads(recommendation.path.read_text())
    assert written["spec"]["template"]["spec"]["containers"] == [{"name": "vllm", "args": argv}]
    assert recommendation.path.parent.parent == tmp_path
    assert "kubectl -n serving patch deployment vllm --type strategic" in recommendation.kubectl
    # The written patch applies cleanly to the live object and passes the schema.
    fake.forbidden.clear()
    runtime_apply = make_runtime(fake, standin.port, tmp_path, promote="apply")
    asyncio.run(asyncio.to_thread(runtime_apply._patch, "vllm", written))
    assert (
        fake.deployment(NAMESPACE, "vllm")["spec"]["template"]["spec"]["containers"][0]["args"]
        == argv
    )


def test_rollout_restart_patches_the_restarted_at_annotation(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    runtime = make_runtime(fake, standin.port, tmp_path, restart="rollout")
    runtime._wall_clock = lambda: 1_700_000_000.0

    asyncio.run(runtime.restart("vllm", drain_timeout_s=5, ready_timeout_s=10))

    annotations = fake.deployment(NAMESPACE, "vllm")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["kubectl.kubernetes.io/restartedAt"] == "2023-11-14T22:13:20Z"


def test_forbidden_names_the_verb_and_resource(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    fake.forbid("create", "deployments")
    runtime = make_runtime(fake, standin.port, tmp_path)

    with pytest.raises(Forbidden) as caught:
        asyncio.run(runtime.start_canary(candidate(standin.port), ready_timeout_s=10))

    message = str(caught.value)
    assert "'create' deployments.apps" in message
    assert "cannot create resource" in message  # the API server's own words
    assert caught.value.status == 403


def test_missing_stable_and_server_errors_are_runtime_failures(fake, standin, tmp_path) -> None:
    runtime = make_runtime(fake, standin.port, tmp_path)
    with pytest.raises(RuntimeFailure, match="serving/vllm not found"):
        runtime.instances()
    fake.add_deployment(base_deployment(standin.port))
    fake.fail("GET", r"/deployments/vllm$", 500)
    with pytest.raises(RuntimeFailure, match=re.escape("HTTP 500 to get deployments.apps")):
        runtime.instances()


def test_the_fake_rejects_an_invalid_body(fake, standin) -> None:
    body = base_deployment(standin.port)
    body["spec"]["replicas"] = "one"
    assert "replicas" in (fake.validate(body) or "")
    body = base_deployment(standin.port)
    body["spec"]["template"]["spec"]["containers"][0]["argz"] = ["--x"]
    assert fake.validate(body) is not None  # strict: unknown fields fail
    status, payload = fake.handle(
        "POST",
        f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
        "application/json",
        json.dumps(body).encode(),
    )
    assert (status, payload["reason"]) == (422, "Invalid")
    assert fake.validate(base_deployment(standin.port)) is None


def test_an_invalid_patch_is_rejected_after_merging(fake, standin, tmp_path) -> None:
    fake.add_deployment(base_deployment(standin.port))
    runtime = make_runtime(fake, standin.port, tmp_path)
    bad = {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": "--x"}]}}}}
    with pytest.raises(RuntimeFailure, match="HTTP 422"):
        runtime._patch("vllm", bad)
    args = fake.deployment(NAMESPACE, "vllm")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert isinstance(args, list)


def test_secrets_are_masked_in_the_recommendation_and_kept_in_the_applied_patch(
    fake, standin, tmp_path
) -> None:
    argv = [*candidate(standin.port), "--api-key=sk-k8s-key-1"]
    fake.add_deployment(base_deployment(standin.port))
    recommend = make_runtime(fake, standin.port, tmp_path, promote="recommend")

    with pytest.raises(PromotionNotApplied, match="masked") as caught:
        asyncio.run(recommend.restart("vllm", drain_timeout_s=5, ready_timeout_s=10, argv=argv))

    written = caught.value.recommendation.path.read_text()
    assert "sk-k8s-key-1" not in written and "--api-key=***" in written
    assert "sk-k8s-key-1" not in caught.value.recommendation.patch
    # Applied through the API, the server keeps its key.
    apply = make_runtime(fake, standin.port, tmp_path, promote="apply")
    asyncio.run(apply.promote(argv, ready_timeout_s=10))
    args = fake.deployment(NAMESPACE, "vllm")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == argv
