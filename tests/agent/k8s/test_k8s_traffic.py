"""Live-traffic canaries' split: real requests through the splitter to stand-in servers.

The fake API server gives the stable pod 127.0.0.2 and the canary's 127.0.0.3; a stand-in
vLLM answers on each, on one port, as two pods would. The splitter reads the fake's
Endpoints or HTTPRoute, as kube-proxy or a Gateway would read the real ones.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes import traffic
from kvpilot.agent.runtimes.kubernetes.api import Forbidden
from kvpilot.agent.runtimes.kubernetes.objects import ContainerCommand, build_canary
from kvpilot.agent.runtimes.kubernetes.traffic import GatewayWeights, ServiceShare
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.fakes.k8s_apiserver import _ROUTES, _VERBS, FakeKubernetesApi
from tests.fakes.k8s_network import HTTPROUTES
from tests.fakes.standin_vllm import StandInVllm
from tests.fakes.traffic_splitter import TrafficSplitter

STABLE_IP, CANARY_IP = "127.0.0.2", "127.0.0.3"
SERVING = {"app.kubernetes.io/name": "vllm", "kvpilot.dev/serving": "true"}
CANARY_SVC = "vllm-kvpilot-canary"


def pod_ip(pod: dict[str, Any]) -> str:
    return {"stable": STABLE_IP, "canary": CANARY_IP}[pod["metadata"]["labels"]["kvpilot.dev/role"]]


@pytest.fixture
def servers() -> Iterator[tuple[StandInVllm, StandInVllm]]:
    """A stand-in on each pod address, on one port (bound again if the port is taken)."""
    for _ in range(5):
        stable = StandInVllm(host=STABLE_IP)
        try:
            canary = StandInVllm(host=CANARY_IP, port=stable.port)
        except OSError:
            stable._server.server_close()
            continue
        with stable, canary:
            yield stable, canary
        return
    pytest.fail("no port free on both loopback addresses")


@pytest.fixture
def fake() -> Iterator[FakeKubernetesApi]:
    with FakeKubernetesApi(pod_ip=pod_ip) as api:
        yield api


def seed(fake: FakeKubernetesApi, port: int, *, service_share: bool) -> dict[str, Any]:
    """The stable Deployment and Service, and a ready canary; returns the canary."""
    body = base_deployment(port)
    vllm = body["spec"]["template"]["spec"]["containers"][0]
    (http,) = [p for p in vllm["ports"] if p["name"] == "http"]  # the Service's targetPort
    http["containerPort"] = port
    selector = {"app.kubernetes.io/name": "vllm", "kvpilot.dev/role": "stable"}
    if service_share:
        body["spec"]["template"]["metadata"]["labels"].update(SERVING)
        selector = SERVING
    stable = fake.add_deployment(body)
    fake.add_service(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "vllm", "namespace": NAMESPACE},
            "spec": {
                "selector": selector,
                "ports": [{"name": "http", "port": 8000, "targetPort": "http"}],
            },
        }
    )
    canary = build_canary(
        stable,
        container="vllm",
        command=ContainerCommand(None, tuple(vllm["args"])),
        sidecar_container="kvpilot",
        serve_labels=SERVING if service_share else None,
    )
    return fake.add_deployment(canary)


def send(splitter: TrafficSplitter, n: int) -> None:
    """`n` completions through the splitter, every other one streamed; each must succeed."""
    with httpx.Client(base_url=splitter.url, timeout=10) as http:
        for i in range(n):
            body = {"model": "stand-in", "prompt": "hi", "max_tokens": 3, "stream": i % 2 == 1}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            if body["stream"]:
                events = re.findall(r"^data: (.*)$", response.text, re.M)
                assert len(events) == 4 and events[-1] == "[DONE]", response.text


@pytest.fixture
def declared(monkeypatch) -> set[tuple[str, str]]:
    """The (verb, resource) each API call of the split names, recorded as it is made."""
    calls: set[tuple[str, str]] = set()
    real = traffic.call

    def recording(fn, *args, verb: str, resource: str, **kw):
        calls.add((verb, resource))
        return real(fn, *args, verb=verb, resource=resource, **kw)

    monkeypatch.setattr(traffic, "call", recording)
    return calls


def writes(fake: FakeKubernetesApi) -> set[tuple[str, str]]:
    """Every (verb, resource) written to the fake (the splitter only reads), as Roles say."""
    full = {"deployments": "deployments.apps", "httproutes": HTTPROUTES}
    out = set()
    for request in fake.writes():
        pattern, resource = next((p, r) for p, r in _ROUTES if p.match(request.path))
        named = pattern.match(request.path).group(2)
        verb = _VERBS[request.method] if named or request.method != "GET" else "list"
        out.add((verb, full.get(resource, resource)))
    return out


def test_service_share_sends_real_requests_and_pulls_them_back(fake, servers, declared) -> None:
    stable_server, canary_server = servers
    port = stable_server.port
    canary = seed(fake, port, service_share=True)
    canary_backend = f"{CANARY_IP}:{port}"
    split = ServiceShare(
        fake.api_client(),
        namespace=NAMESPACE,
        service="vllm",
        canary_selector=canary["spec"]["selector"]["matchLabels"],
    )

    assert asyncio.run(split.canary_labels()) == SERVING  # what build_canary was given

    with TrafficSplitter(fake.host, NAMESPACE, service="vllm") as splitter:
        fake.requests.clear()
        shares = asyncio.run(split.send_share(10))
        assert (shares.stable_percent, shares.canary_percent) == (50.0, 50.0)
        assert "1 of 2 ready endpoints are the canary's" in shares.how
        assert "not the 10 % asked for" in shares.how
        splitter.wait_until(lambda s: canary_backend in s.table, timeout_s=5)
        send(splitter, 20)
        assert splitter.count(canary_backend) == 10  # one of two ready endpoints
        assert canary_server.completions_total == 10
        canary_pod = fake.pods_of(NAMESPACE, CANARY_SVC)[0]["metadata"]["name"]

        shares = asyncio.run(split.pull_back())

        assert (shares.stable_percent, shares.canary_percent) == (100.0, 0.0)
        splitter.wait_until(lambda s: canary_backend not in s.table, timeout_s=5)
        send(splitter, 20)
        assert splitter.count(canary_backend) == 10  # not one more
        assert canary_server.completions_total == 10
        assert stable_server.completions_total == 30
    # The pod was not replaced: only the Service's own label came off it.
    (pod,) = fake.pods_of(NAMESPACE, CANARY_SVC)
    assert pod["metadata"]["name"] == canary_pod
    assert "kvpilot.dev/serving" not in pod["metadata"]["labels"]
    assert writes(fake) == {("patch", "pods")}
    assert declared == ServiceShare.API_CALLS

    shares = asyncio.run(split.send_share(10))  # and back in
    assert shares.canary_percent == 50.0


def test_gateway_weights_send_a_tenth_and_pull_it_back_in_one_patch(
    fake, servers, declared
) -> None:
    stable_server, canary_server = servers
    port = stable_server.port
    canary = seed(fake, port, service_share=False)
    fake.add_httproute(
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": "vllm", "namespace": NAMESPACE},
            "spec": {
                "parentRefs": [{"name": "gateway"}],
                "rules": [{"backendRefs": [{"name": "vllm", "port": 8000}]}],
            },
        }
    )
    canary_backend = f"{CANARY_IP}:{port}"
    split = GatewayWeights(
        fake.api_client(),
        namespace=NAMESPACE,
        route="vllm",
        stable_service="vllm",
        canary_service=CANARY_SVC,
        canary_selector=canary["spec"]["selector"]["matchLabels"],
    )

    with TrafficSplitter(fake.host, NAMESPACE, route="vllm") as splitter:
        assert splitter.table == {f"{STABLE_IP}:{port}": 1.0}  # the canary is in no Service
        fake.requests.clear()
        shares = asyncio.run(split.send_share(10))
        assert (shares.stable_percent, shares.canary_percent) == (90.0, 10.0)
        assert shares.how == "HTTPRoute vllm: weights 90/10"
        refs = fake.httproute(NAMESPACE, "vllm")["spec"]["rules"][0]["backendRefs"]
        assert refs == [
            {"name": "vllm", "port": 8000, "weight": 90},
            {"name": CANARY_SVC, "port": 8000, "weight": 10},
        ]
        assert fake.service(NAMESPACE, CANARY_SVC)["spec"]["selector"]["kvpilot.dev/role"] == (
            "canary"
        )
        splitter.wait_until(lambda s: canary_backend in s.table, timeout_s=5)
        send(splitter, 50)
        assert splitter.count(canary_backend) == 5
        assert canary_server.completions_total == 5
        patches_before = len(fake.writes("PATCH"))

        shares = asyncio.run(split.pull_back())

        assert (shares.stable_percent, shares.canary_percent) == (100.0, 0.0)
        first = fake.writes("PATCH")[patches_before].body
        assert {"op": "replace", "path": "/spec/rules/0/backendRefs/1/weight", "value": 0} in first
        splitter.wait_until(lambda s: canary_backend not in s.table, timeout_s=5)
        send(splitter, 20)
        assert splitter.count(canary_backend) == 5  # not one more
        assert canary_server.completions_total == 5
    refs = fake.httproute(NAMESPACE, "vllm")["spec"]["rules"][0]["backendRefs"]
    assert refs == [{"name": "vllm", "port": 8000}]  # as it was found
    assert fake.service(NAMESPACE, CANARY_SVC) is None
    assert writes(fake) == {("create", "services"), ("delete", "services"), ("patch", HTTPROUTES)}
    assert declared == GatewayWeights.API_CALLS


def test_gateway_weights_follow_a_route_changed_in_between(fake) -> None:
    canary = seed(fake, 8000, service_share=False)
    fake.add_httproute(
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": "vllm", "namespace": NAMESPACE},
            "spec": {
                "parentRefs": [{"name": "gateway"}],
                "rules": [
                    {"backendRefs": [{"name": "other", "port": 80}]},
                    {"backendRefs": [{"name": "vllm", "port": 8000, "weight": 3}]},
                ],
            },
        }
    )
    split = GatewayWeights(
        fake.api_client(),
        namespace=NAMESPACE,
        route="vllm",
        stable_service="vllm",
        canary_service=CANARY_SVC,
        canary_selector=canary["spec"]["selector"]["matchLabels"],
    )
    read = split._read_route
    reads = []

    async def read_then_someone_writes() -> dict[str, Any]:
        route = await read()
        reads.append(route)
        if len(reads) == 1:  # another writer's patch lands between our read and our patch
            fake.handle(
                "PATCH",
                "/apis/gateway.networking.k8s.io/v1/namespaces/serving/httproutes/vllm",
                "application/merge-patch+json",
                b'{"metadata": {"labels": {"team": "serving"}}}',
            )
        return route

    split._read_route = read_then_someone_writes

    shares = asyncio.run(split.send_share(12.5))

    assert (shares.stable_percent, shares.canary_percent) == (87.5, 12.5)
    rules = fake.httproute(NAMESPACE, "vllm")["spec"]["rules"]
    assert rules[0]["backendRefs"] == [{"name": "other", "port": 80}]  # untouched
    assert [r["weight"] for r in rules[1]["backendRefs"]] == [8750, 1250]
    assert fake.httproute(NAMESPACE, "vllm")["metadata"]["labels"] == {"team": "serving"}
    ours = [r.body for r in fake.writes("PATCH") if isinstance(r.body, list)]
    versions = [ops[0]["value"] for ops in ours]  # each patch first tests the version it read
    assert len(versions) == 2 and versions[0] == reads[0]["metadata"]["resourceVersion"]
    assert versions[1] != versions[0]  # the first was refused, the second read again


def test_an_out_of_range_share_is_refused_before_any_write(fake) -> None:
    canary = seed(fake, 8000, service_share=False)
    split = GatewayWeights(
        fake.api_client(),
        namespace=NAMESPACE,
        route="vllm",
        stable_service="vllm",
        canary_service=CANARY_SVC,
        canary_selector=canary["spec"]["selector"]["matchLabels"],
    )
    fake.requests.clear()
    with pytest.raises(ValueError, match="0-100 %"):
        asyncio.run(split.send_share(150))
    assert fake.writes() == []


@pytest.mark.parametrize(
    ("selector", "why"),
    [
        # The canary's pods carry none of the stable's labels: only a Service selecting on
        # kvpilot's own canary label could not be left without replacing the pod.
        ({"kvpilot.dev/canary-of": "vllm"}, "replacing the pod"),
        ({"app.kubernetes.io/name": "vllm", "kvpilot.dev/role": "stable"}, "selects on"),
    ],
)
def test_service_share_refuses_a_service_it_could_not_pull_back_from(
    fake, selector: dict[str, str], why: str
) -> None:
    canary = seed(fake, 8000, service_share=False)
    fake.services[(NAMESPACE, "vllm")]["spec"]["selector"] = selector
    split = ServiceShare(
        fake.api_client(),
        namespace=NAMESPACE,
        service="vllm",
        canary_selector=canary["spec"]["selector"]["matchLabels"],
    )
    with pytest.raises(RuntimeFailure, match=why):
        asyncio.run(split.send_share(10))
    assert fake.writes() == []


def test_build_canary_keeps_the_service_labels_only_when_asked(fake) -> None:
    stable = fake.add_deployment(base_deployment(8000))
    command = ContainerCommand(None, ("--model=m",))
    plain = build_canary(stable, container="vllm", command=command, sidecar_container=None)
    shared = build_canary(
        stable, container="vllm", command=command, sidecar_container=None, serve_labels=SERVING
    )

    assert "kvpilot.dev/serving" not in plain["spec"]["template"]["metadata"]["labels"]
    labels = shared["spec"]["template"]["metadata"]["labels"]
    assert labels["kvpilot.dev/serving"] == "true"
    assert labels["kvpilot.dev/role"] == "canary"
    assert "kvpilot.dev/serving" not in shared["spec"]["selector"]["matchLabels"]
    with pytest.raises(ValueError, match="cannot share"):
        build_canary(
            stable,
            container="vllm",
            command=command,
            sidecar_container=None,
            serve_labels={"kvpilot.dev/role": "stable"},
        )


def test_a_refused_pull_back_names_the_verb_and_the_resource(fake) -> None:
    canary = seed(fake, 8000, service_share=True)
    split = ServiceShare(
        fake.api_client(),
        namespace=NAMESPACE,
        service="vllm",
        canary_selector=canary["spec"]["selector"]["matchLabels"],
    )
    fake.forbid("patch", "pods")

    with pytest.raises(Forbidden, match="may not 'patch' pods") as caught:
        asyncio.run(split.pull_back())

    assert "the Role 'kvpilot-tuning' grants it" in str(caught.value)
    (subset,) = fake.endpoints(NAMESPACE, "vllm")["subsets"]
    assert {a["ip"] for a in subset["addresses"]} == {STABLE_IP, CANARY_IP}  # still in


def test_a_route_split_between_two_backends_keeps_their_proportions_and_is_put_back(
    fake,
) -> None:
    canary = seed(fake, 8000, service_share=False)
    found = [
        {"name": "vllm", "port": 8000, "weight": 50},
        {"name": "vllm-next", "port": 8000, "weight": 50},
    ]
    fake.add_httproute(
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": "vllm", "namespace": NAMESPACE},
            "spec": {"parentRefs": [{"name": "gateway"}], "rules": [{"backendRefs": found}]},
        }
    )
    split = GatewayWeights(
        fake.api_client(),
        namespace=NAMESPACE,
        route="vllm",
        stable_service="vllm",
        canary_service=CANARY_SVC,
        canary_selector=canary["spec"]["selector"]["matchLabels"],
    )

    shares = asyncio.run(split.send_share(10))

    refs = fake.httproute(NAMESPACE, "vllm")["spec"]["rules"][0]["backendRefs"]
    assert [(r["name"], r["weight"]) for r in refs] == [
        ("vllm", 45),
        ("vllm-next", 45),  # its half of the rest, not 50 beside 90
        (CANARY_SVC, 10),
    ]
    assert shares.canary_percent == 10.0

    back = asyncio.run(split.pull_back())

    assert fake.httproute(NAMESPACE, "vllm")["spec"]["rules"][0]["backendRefs"] == found
    assert back.canary_percent == 0.0
