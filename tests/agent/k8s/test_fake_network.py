"""The fake API server's Services, Endpoints and HTTPRoutes, through the official client."""

from __future__ import annotations

import copy

import pytest
from kubernetes import client

from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.fakes.gateway_schema import MODEL_FILE, httproute_schema, validate_httproute
from tests.fakes.k8s_apiserver import FakeKubernetesApi

GROUP, VERSION, PLURAL = "gateway.networking.k8s.io", "v1", "httproutes"
JSON_PATCH = "application/json-patch+json"
IPS = {"stable": "127.0.0.2", "canary": "127.0.0.3"}


def pod_ip(pod: dict) -> str:
    return IPS[pod["metadata"]["labels"]["kvpilot.dev/role"]]


def service(selector: dict[str, str], name: str = "vllm") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "port": 8000, "targetPort": "http"}],
        },
    }


def route(*refs: dict) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "HTTPRoute",
        "metadata": {"name": "vllm", "namespace": NAMESPACE},
        "spec": {"parentRefs": [{"name": "gateway"}], "rules": [{"backendRefs": list(refs)}]},
    }


def canary_body(port: int) -> dict:
    body = base_deployment(port)
    body["metadata"]["name"] = "vllm-kvpilot-canary"
    for labels in (
        body["metadata"]["labels"],
        body["spec"]["selector"]["matchLabels"],
        body["spec"]["template"]["metadata"]["labels"],
    ):
        labels["kvpilot.dev/role"] = "canary"
    return body


@pytest.fixture
def fake():
    with FakeKubernetesApi(pod_ip=pod_ip) as api:
        yield api


def addresses(fake: FakeKubernetesApi, name: str = "vllm") -> tuple[list[str], list[str]]:
    subsets = fake.endpoints(NAMESPACE, name).get("subsets") or []
    ready = [a["ip"] for s in subsets for a in s.get("addresses") or ()]
    waiting = [a["ip"] for s in subsets for a in s.get("notReadyAddresses") or ()]
    return sorted(ready), sorted(waiting)


def test_endpoints_follow_the_selector_readiness_and_deletion(fake) -> None:
    fake.add_deployment(base_deployment(8000))
    fake.add_deployment(canary_body(8000))
    core = client.CoreV1Api(fake.api_client())
    core.create_namespaced_service(NAMESPACE, service({"app.kubernetes.io/name": "vllm"}))

    endpoints = core.read_namespaced_endpoints("vllm", NAMESPACE)
    (subset,) = endpoints.subsets
    assert sorted(a.ip for a in subset.addresses) == ["127.0.0.2", "127.0.0.3"]
    assert [(p.name, p.port) for p in subset.ports] == [("http", 8000)]  # the named targetPort
    assert {a.target_ref.kind for a in subset.addresses} == {"Pod"}

    canary_pod = fake.pods_of(NAMESPACE, "vllm-kvpilot-canary")[0]["metadata"]["name"]
    fake.set_pod_ready(NAMESPACE, canary_pod, False)
    assert addresses(fake) == (["127.0.0.2"], ["127.0.0.3"])
    fake.set_pod_ready(NAMESPACE, canary_pod, True)
    assert addresses(fake) == (["127.0.0.2", "127.0.0.3"], [])

    core.delete_namespaced_pod(canary_pod, NAMESPACE)
    assert addresses(fake) == (["127.0.0.2"], [])  # gone at once; its replacement not ready
    (replacement,) = fake.pods_of(NAMESPACE, "vllm-kvpilot-canary")
    assert replacement["metadata"]["name"] != canary_pod

    client.AppsV1Api(fake.api_client()).delete_namespaced_deployment("vllm", NAMESPACE)
    assert addresses(fake) == ([], [])


def test_a_label_taken_off_a_pod_takes_it_out_of_the_endpoints(fake) -> None:
    fake.add_deployment(base_deployment(8000))
    core = client.CoreV1Api(fake.api_client())
    pod = fake.pods_of(NAMESPACE, "vllm")[0]["metadata"]["name"]
    core.patch_namespaced_pod(pod, NAMESPACE, {"metadata": {"labels": {"serving": "yes"}}})
    fake.add_service(service({"app.kubernetes.io/name": "vllm", "serving": "yes"}))
    assert addresses(fake) == (["127.0.0.2"], [])

    core.patch_namespaced_pod(pod, NAMESPACE, {"metadata": {"labels": {"serving": None}}})

    assert addresses(fake) == ([], [])
    assert core.read_namespaced_pod(pod, NAMESPACE).metadata.labels.get("serving") is None


def test_services_are_validated_and_merge_ports_by_port(fake) -> None:
    core = client.CoreV1Api(fake.api_client())
    bad = service({"app": "x"})
    bad["spec"]["ports"][0]["port"] = "eight thousand"
    with pytest.raises(client.ApiException) as caught:
        core.create_namespaced_service(NAMESPACE, bad)
    assert caught.value.status == 422
    created = core.create_namespaced_service(NAMESPACE, service({"app": "x"}))
    assert created.spec.cluster_ip

    patched = core.patch_namespaced_service(
        "vllm", NAMESPACE, {"spec": {"ports": [{"port": 9400, "name": "kvpilot"}]}}
    )

    assert [(p.name, p.port) for p in patched.spec.ports] == [("http", 8000), ("kvpilot", 9400)]


def test_the_schema_comes_from_the_published_package() -> None:
    assert MODEL_FILE.is_file(), "run ./scripts/setup"
    schema = httproute_schema()
    weight = schema["properties"]["spec"]["properties"]["rules"]["items"]["properties"][
        "backendRefs"
    ]["items"]["properties"]["weight"]
    assert (weight["minimum"], weight["maximum"]) == (0, 1000000)
    good = route({"name": "vllm", "port": 8000, "weight": 90})
    assert validate_httproute(good) == []
    no_rules_name = copy.deepcopy(good)
    del no_rules_name["spec"]["rules"][0]["backendRefs"][0]["name"]
    assert validate_httproute(no_rules_name) == [
        "spec.rules[0].backendRefs[0]: 'name' is a required property"
    ]


def test_an_invalid_httproute_patch_is_refused_with_the_schemas_reason(fake) -> None:
    fake.add_httproute(route({"name": "vllm", "port": 8000}))
    api = client.CustomObjectsApi(fake.api_client())
    args = (GROUP, VERSION, NAMESPACE, PLURAL, "vllm")

    with pytest.raises(client.ApiException) as caught:
        api.patch_namespaced_custom_object(
            *args,
            [
                {
                    "op": "add",
                    "path": "/spec/rules/0/backendRefs/-",
                    "value": {"name": "vllm-canary", "port": 8000, "weight": 2000000},
                }
            ],
            _content_type=JSON_PATCH,
        )

    assert caught.value.status == 422
    assert (
        "spec.rules[0].backendRefs[1].weight: 2000000 is greater than the maximum of "
        "1000000" in caught.value.body
    )
    assert fake.httproute(NAMESPACE, "vllm")["spec"]["rules"][0]["backendRefs"] == [
        {"name": "vllm", "port": 8000}
    ]


def test_httproutes_take_json_and_merge_patches_not_strategic_ones(fake) -> None:
    fake.add_httproute(route({"name": "vllm", "port": 8000}))
    api = client.CustomObjectsApi(fake.api_client())
    args = (GROUP, VERSION, NAMESPACE, PLURAL, "vllm")

    with pytest.raises(client.ApiException) as caught:
        api.patch_namespaced_custom_object(
            *args,
            {"metadata": {"labels": {"a": "b"}}},
            _content_type="application/strategic-merge-patch+json",
        )
    assert caught.value.status == 415
    with pytest.raises(client.ApiException) as caught:  # a failed `test` applies nothing
        api.patch_namespaced_custom_object(
            *args,
            [
                {"op": "test", "path": "/spec/rules/0/backendRefs/0/name", "value": "other"},
                {"op": "replace", "path": "/spec/rules/0/backendRefs/0/port", "value": 1},
            ],
            _content_type=JSON_PATCH,
        )
    assert caught.value.status == 422

    patched = api.patch_namespaced_custom_object(
        *args,
        [{"op": "add", "path": "/spec/rules/0/backendRefs/0/weight", "value": 7}],
        _content_type=JSON_PATCH,
    )
    assert patched["spec"]["rules"][0]["backendRefs"][0]["weight"] == 7
    assert patched["metadata"]["generation"] == 2
    stale = {"metadata": {"resourceVersion": "1", "labels": {"a": "b"}}}
    with pytest.raises(client.ApiException) as caught:
        api.patch_namespaced_custom_object(
            *args, stale, _content_type="application/merge-patch+json"
        )
    assert caught.value.status == 409
