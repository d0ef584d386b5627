"""The traffic split of a live-traffic canary: how much of the real traffic reaches it.

Two ways, both through the Kubernetes API (kvpilot is never in the data path):

* `ServiceShare`: the Service selects stable and canary pods alike; each ready endpoint
  gets an equal share (kube-proxy), so the canary's share is its ready endpoints over all.
* `GatewayWeights`: an HTTPRoute (Gateway API) fronts the model; the canary gets a backend
  Service of its own and a weight beside the stable Service's.

Every API call goes through `call` and names its verb and resource; `API_CALLS` lists them
for the least-privilege check against the Role.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes import route_weights as weights
from kvpilot.agent.runtimes.kubernetes.api import KubernetesApiError, NotFound, call, client_module
from kvpilot.agent.runtimes.kubernetes.objects import CANARY_OF_ANNOTATION, ROLE_LABEL
from kvpilot.agent.runtimes.kubernetes.route_weights import is_service, split_rules

log = logging.getLogger(__name__)
T = TypeVar("T")
SERVICES = "services"
ENDPOINTS = "endpoints"
PODS = "pods"
GATEWAY_GROUP, GATEWAY_VERSION, HTTPROUTES_PLURAL = "gateway.networking.k8s.io", "v1", "httproutes"
HTTPROUTES = f"{HTTPROUTES_PLURAL}.{GATEWAY_GROUP}"
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
PATCH_ATTEMPTS = 3  # an HTTPRoute changed by someone else between our read and our patch


@dataclass(frozen=True, slots=True)
class Shares:
    """What each side receives now, in percent of the requests, and how that was found."""

    stable_percent: float
    canary_percent: float
    how: str  # e.g. "Service vllm: 1 of 2 ready endpoints are the canary's"


class TrafficSplit(Protocol):
    async def send_share(self, canary_percent: float) -> Shares:
        """Route the share to the canary (its ready pods exist)."""
        ...

    async def pull_back(self) -> Shares:
        """Every request back to stable at once (on abort and before removing the canary)."""
        ...

    async def shares(self) -> Shares:
        """What each side receives now."""
        ...


def _percent_check(canary_percent: float) -> None:
    if not 0.0 <= canary_percent <= 100.0:
        raise ValueError(f"a canary share is 0-100 %, not {canary_percent}")


class _Api:
    """The official client's APIs for one namespace; blocking calls run in a thread."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        client = client_module()
        self.namespace = namespace
        self.client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    def json(self, model: Any) -> Any:
        return self.client.sanitize_for_serialization(model)

    async def run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await asyncio.to_thread(call, fn, *args, **kw)

    async def service(self, name: str) -> dict[str, Any] | None:
        try:
            found = await self.run(
                self.core.read_namespaced_service,
                name,
                self.namespace,
                verb="get",
                resource=SERVICES,
                what=f"Service {self.namespace}/{name}",
            )
        except NotFound:
            return None
        service: dict[str, Any] = self.json(found)
        return service

    async def pods(self, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        text = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        found = await self.run(
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=text,
            verb="list",
            resource=PODS,
            what=f"pods {text!r} in {self.namespace}",
        )
        return [self.json(pod) for pod in found.items]


class ServiceShare:
    """The canary's pods join the stable's Service; the share follows ready replicas.

    The Service selects labels that both roles' pods carry; at least one of them (for
    example `kvpilot.dev/serving: "true"`) must not be in the canary Deployment's own
    selector (`canary_selector`). `pull_back` takes that label off the canary's pods: the
    endpoints controller drops a pod from the Endpoints on the pod's update, one write and
    one controller hop, and the ReplicaSet keeps the pod because its selector still
    matches. Deleting the pods would have the ReplicaSet start replacements that rejoin
    when ready, and deleting or scaling the Deployment goes through the garbage collector
    or the ReplicaSet controller before the pods' deletion, a hop or two more. A pod the
    ReplicaSet makes later (a crash) carries the template's labels again: remove the canary
    right after (as an abort does).
    """

    API_CALLS: ClassVar[frozenset[tuple[str, str]]] = frozenset(
        {("get", SERVICES), ("get", ENDPOINTS), ("list", PODS), ("patch", PODS)}
    )

    def __init__(
        self, api_client: Any, *, namespace: str, service: str, canary_selector: Mapping[str, str]
    ) -> None:
        self._api = _Api(api_client, namespace)
        self.service = service
        self.canary_selector = dict(canary_selector)
        self._asked: float | None = None

    async def _selector(self) -> tuple[dict[str, str], dict[str, str]]:
        """The Service's selector, and its labels that the canary's ReplicaSet does not
        select on (those `pull_back` takes off), once checked."""
        service = await self._api.service(self.service)
        if service is None:
            raise RuntimeFailure(f"Service {self._api.namespace}/{self.service} not found")
        selector = (service.get("spec") or {}).get("selector") or {}
        if ROLE_LABEL in selector:
            raise RuntimeFailure(
                f"Service {self.service} selects on {ROLE_LABEL}: it cannot share traffic with "
                "a canary; select the pods of both roles"
            )
        clash = {k for k, v in selector.items() if self.canary_selector.get(k, v) != v}
        if clash:
            raise RuntimeFailure(
                f"Service {self.service} selects {sorted(clash)} with values other than the "
                "canary's pods carry: it would never send them traffic"
            )
        own = {k: v for k, v in selector.items() if k not in self.canary_selector}
        if not own:
            raise RuntimeFailure(
                f"Service {self.service} selects only labels the canary's ReplicaSet selects "
                f"on ({sorted(selector)}): no label could take a canary pod out of it at once "
                "without the ReplicaSet replacing the pod; give the Service and the stable pod "
                'template a label of their own, such as kvpilot.dev/serving: "true"'
            )
        return dict(selector), own

    async def canary_labels(self) -> dict[str, str]:
        """What the canary's pods must carry for the Service to select them (`build_canary`'s
        `serve_labels`): the Service's selector, once checked that it can be pulled back."""
        return (await self._selector())[0]

    async def _label(self, pod: dict[str, Any], labels: Mapping[str, str | None]) -> None:
        name = pod["metadata"]["name"]
        await self._api.run(
            self._api.core.patch_namespaced_pod,
            name,
            self._api.namespace,
            {"metadata": {"labels": dict(labels)}},
            _content_type=MERGE_PATCH,
            verb="patch",
            resource=PODS,
            what=f"pod {self._api.namespace}/{name}",
        )

    async def send_share(self, canary_percent: float) -> Shares:
        """Label the canary's pods so the Service selects them (built so, they already are)."""
        _percent_check(canary_percent)
        _, labels = await self._selector()
        self._asked = canary_percent
        for pod in await self._api.pods(self.canary_selector):
            current = pod["metadata"].get("labels") or {}
            if any(current.get(k) != v for k, v in labels.items()):
                await self._label(pod, labels)
        return await self.shares()

    async def pull_back(self) -> Shares:
        """Take the Service's own labels off the canary's pods: out of the Endpoints at once."""
        _, labels = await self._selector()
        for pod in await self._api.pods(self.canary_selector):
            current = pod["metadata"].get("labels") or {}
            if any(k in current for k in labels):
                await self._label(pod, dict.fromkeys(labels))
        self._asked = None
        return await self.shares()

    async def shares(self) -> Shares:
        what = f"Endpoints {self._api.namespace}/{self.service}"
        endpoints = self._api.json(
            await self._api.run(
                self._api.core.read_namespaced_endpoints,
                self.service,
                self._api.namespace,
                verb="get",
                resource=ENDPOINTS,
                what=what,
            )
        )
        ready = {
            (a.get("targetRef") or {}).get("name") or a["ip"]
            for subset in endpoints.get("subsets") or ()
            for a in subset.get("addresses") or ()
        }
        canary_pods = {p["metadata"]["name"] for p in await self._api.pods(self.canary_selector)}
        canary = len(ready & canary_pods)
        how = f"Service {self.service}: {canary} of {len(ready)} ready endpoints are the canary's"
        if self._asked is not None:
            how += f" (the share follows ready replicas, not the {self._asked:g} % asked for)"
        if not ready:
            return Shares(0.0, 0.0, how)
        canary_percent = 100.0 * canary / len(ready)
        return Shares(100.0 - canary_percent, canary_percent, how)


def _weights(canary_percent: float) -> tuple[int, int]:
    """(stable, canary) HTTPRoute weights: whole percents, or hundredths of one."""
    scale = 1 if float(canary_percent).is_integer() else 100
    canary = round(canary_percent * scale)
    return 100 * scale - canary, canary


class GatewayWeights:
    """The canary's backend Service and its weight in the HTTPRoute's rules.

    `send_share` creates the canary Service (selecting only the canary's pods, the stable
    Service's ports) when missing and sets, in every rule that routes to the stable
    Service, the stable weight to 100-w and the canary's to w. `pull_back` sets the canary
    weight to 0 in one patch, then removes the canary's backendRefs and its Service.
    Patches are JSON patches (a custom resource takes no strategic merge) that first test
    the resourceVersion read and the names at the indices they change.
    """

    API_CALLS: ClassVar[frozenset[tuple[str, str]]] = frozenset(
        {
            ("get", SERVICES),
            ("create", SERVICES),
            ("delete", SERVICES),
            ("get", HTTPROUTES),
            ("patch", HTTPROUTES),
        }
    )

    def __init__(
        self,
        api_client: Any,
        *,
        namespace: str,
        route: str,
        stable_service: str,
        canary_service: str,
        canary_selector: Mapping[str, str],
    ) -> None:
        self._api = _Api(api_client, namespace)
        self.route = route
        self.stable_service = stable_service
        self.canary_service = canary_service
        self.canary_selector = dict(canary_selector)
        self.found: weights.Found | None = None  # the split rules' weights before ours

    # -- API calls -------------------------------------------------------------------------

    async def _read_route(self) -> dict[str, Any]:
        what = f"HTTPRoute {self._api.namespace}/{self.route}"
        return await self._api.run(
            self._api.custom.get_namespaced_custom_object,
            GATEWAY_GROUP,
            GATEWAY_VERSION,
            self._api.namespace,
            HTTPROUTES_PLURAL,
            self.route,
            verb="get",
            resource=HTTPROUTES,
            what=what,
        )

    async def _version(self) -> str | None:
        version: str | None = (await self._read_route())["metadata"].get("resourceVersion")
        return version

    async def _patch_route(
        self, ops_for: Callable[[dict[str, Any]], Sequence[dict[str, Any]]]
    ) -> dict[str, Any]:
        """Read, build the ops, patch; again when the route changed in between."""
        what = f"HTTPRoute {self._api.namespace}/{self.route}"
        for attempt in range(PATCH_ATTEMPTS):
            route = await self._read_route()
            ops = list(ops_for(route))
            if not ops:
                return route
            version = route["metadata"]["resourceVersion"]
            guard = {"op": "test", "path": "/metadata/resourceVersion", "value": version}
            try:
                return await self._api.run(
                    self._api.custom.patch_namespaced_custom_object,
                    GATEWAY_GROUP,
                    GATEWAY_VERSION,
                    self._api.namespace,
                    HTTPROUTES_PLURAL,
                    self.route,
                    [guard, *ops],
                    _content_type=JSON_PATCH,
                    verb="patch",
                    resource=HTTPROUTES,
                    what=what,
                )
            except KubernetesApiError as exc:
                if attempt + 1 == PATCH_ATTEMPTS or exc.status not in (409, 422):
                    raise
                # 422 is also a patch the schema refuses: again only if the route changed.
                if exc.status == 422 and await self._version() == version:
                    raise
        raise AssertionError("unreachable")

    async def _ensure_canary_service(self) -> int:
        """The canary's backend Service (created when missing); the port to route to."""
        stable = await self._api.service(self.stable_service)
        if stable is None:
            raise RuntimeFailure(f"Service {self._api.namespace}/{self.stable_service} not found")
        if await self._api.service(self.canary_service) is None:
            ports = [
                {k: v for k, v in p.items() if k != "nodePort"}
                for p in stable["spec"].get("ports") or ()
            ]
            body = {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": self.canary_service,
                    "namespace": self._api.namespace,
                    "labels": {ROLE_LABEL: "canary"},
                    "annotations": {CANARY_OF_ANNOTATION: self.stable_service},
                },
                "spec": {"selector": self.canary_selector, "ports": ports},
            }
            what = f"Service {self._api.namespace}/{self.canary_service}"
            await self._api.run(
                self._api.core.create_namespaced_service,
                self._api.namespace,
                body,
                verb="create",
                resource=SERVICES,
                what=what,
            )
        return int(stable["spec"]["ports"][0]["port"])

    # -- the split -------------------------------------------------------------------------

    async def send_share(self, canary_percent: float) -> Shares:
        _percent_check(canary_percent)
        port = await self._ensure_canary_service()
        stable_w, canary_w = _weights(canary_percent)
        total = stable_w + canary_w
        await self._patch_route(lambda route: self._share_ops(route, total, canary_w, port))
        return await self.shares()

    def _share_ops(self, route: dict[str, Any], total: int, canary_w: int, port: int) -> Any:
        if not split_rules(route, self.stable_service):
            raise RuntimeFailure(
                f"HTTPRoute {self.route} has no rule routing to Service {self.stable_service}"
            )
        if self.found is None:  # the route as kvpilot found it, to put back at the end
            kept = weights.from_annotation(route)
            self.found = kept or weights.found(route, self.stable_service, self.canary_service)
        ops = weights.share_ops(route, self.found, self.canary_service, total, canary_w, port)
        return [*ops, *weights.annotate_ops(route, self.found)]

    def _back_ops(self, route: dict[str, Any]) -> list[dict[str, Any]]:
        """Canary weights to 0, the others back to what they were found at."""
        was = self.found or weights.from_annotation(route)  # another pod's canary: the route's
        return weights.restore_ops(route, was, self.stable_service, self.canary_service)

    def _remove_ops(self, route: dict[str, Any]) -> list[dict[str, Any]]:
        ops: list[dict[str, Any]] = []
        for r, rule in enumerate((route.get("spec") or {}).get("rules") or ()):
            refs = rule.get("backendRefs") or ()
            for j in reversed(range(len(refs))):  # from the end: indices stay true
                if is_service(refs[j], self.canary_service):
                    path = f"/spec/rules/{r}/backendRefs/{j}"
                    ops += [
                        {"op": "test", "path": f"{path}/name", "value": self.canary_service},
                        {"op": "remove", "path": path},
                    ]
        return [*ops, *weights.unannotate_ops(route)]

    async def pull_back(self) -> Shares:
        await self._patch_route(self._back_ops)  # the one patch that brings traffic back
        self.found = None  # put back: the next share starts from the route as it is then
        tidy = ""
        try:
            await self._patch_route(self._remove_ops)
            await self._api.run(
                self._api.core.delete_namespaced_service,
                self.canary_service,
                self._api.namespace,
                verb="delete",
                resource=SERVICES,
                what=f"Service {self._api.namespace}/{self.canary_service}",
            )
        except NotFound:
            pass
        except RuntimeFailure as exc:  # the traffic is back; what is left is weight 0
            log.warning("canary backend left in HTTPRoute %s at weight 0: %s", self.route, exc)
            tidy = f"; canary backend left at weight 0 ({exc})"
        shares = await self.shares()
        return Shares(shares.stable_percent, shares.canary_percent, shares.how + tidy)

    async def shares(self) -> Shares:
        route = await self._read_route()
        rules = split_rules(route, self.stable_service)
        if not rules:
            raise RuntimeFailure(
                f"HTTPRoute {self.route} has no rule routing to Service {self.stable_service}"
            )
        refs = route["spec"]["rules"][rules[0]]["backendRefs"]
        weight = {"stable": 0, "canary": 0, "other": 0}
        for ref in refs:
            side = (
                "stable"
                if is_service(ref, self.stable_service)
                else "canary"
                if is_service(ref, self.canary_service)
                else "other"
            )
            weight[side] += int(ref.get("weight", 1))
        total = sum(weight.values())
        how = f"HTTPRoute {self.route}: weights {weight['stable']}/{weight['canary']}"
        if weight["other"]:
            how += f" (and {weight['other']} to other backends)"
        if len(rules) > 1:
            how += f", in each of {len(rules)} rules"
        if not total:
            return Shares(0.0, 0.0, how)
        return Shares(100.0 * weight["stable"] / total, 100.0 * weight["canary"] / total, how)
