"""A fake of the Kubernetes API for tests: the few endpoints the Kubernetes runtime calls
(Deployments, Pods, Leases, core/v1 Events).

A real HTTP server on a loopback port (in a thread) that the official client talks to.
Objects live in memory; every created, replaced or patched object is validated against the
Kubernetes JSON schemas (`kubernetes-validate`, strict) and answers 422 when it does not
fit; responses are built from the official client's models. Rollouts finish after a given
number of reads, pods turn ready after a given number of lists, and any request can be made
to answer 403/404/409/500. Strategic-merge patches are merged the way the API server merges
the fields the runtime touches (containers, env, ports, volumes by their keys); other lists
are replaced. Services, their Endpoints (computed from the selector over the fake's pods),
HTTPRoutes (validated with the Gateway API's published schema) and single pods are in
tests/fakes/k8s_network.py. Pods get `pod_ip` (one address, or a function of the pod: tests
give pods distinct loopback addresses, 127.0.0.N, to tell servers on one port apart).

It is a fake, not a Kubernetes: no scheduler, kubelet, kube-proxy or Gateway data plane
(tests/fakes/traffic_splitter.py stands in for those), no controllers beyond the ones
named here, no watches, no admission (CEL rules, defaults), no auth beyond `forbid`.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlparse

import jsonschema
import kubernetes_validate
from kubernetes import client
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from tests.fakes.k8s_network import (
    NETWORK_API_VERSIONS,
    NETWORK_GROUPS,
    NETWORK_KINDS,
    NETWORK_ROUTES,
    NetworkObjects,
)
from tests.http_helpers import ServedInThread, send_json

SCHEMA_VERSION = kubernetes_validate.latest_version()
_ROUTES = [
    (re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments(?:/([^/]+))?$"), "deployments"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?$"), "pods"),
    (
        re.compile(r"^/apis/coordination.k8s.io/v1/namespaces/([^/]+)/leases(?:/([^/]+))?$"),
        "leases",
    ),
    *NETWORK_ROUTES,
    (re.compile(r"^/api/v1/namespaces/([^/]+)/events(?:/([^/]+))?$"), "events"),
]
_GROUPS = {"deployments": "apps", "pods": "", "leases": "coordination.k8s.io", **NETWORK_GROUPS}
_MODELS = {"deployments": "V1Deployment", "pods": "V1Pod", "leases": "V1Lease", **NETWORK_KINDS}
_LISTS = {"deployments": "V1DeploymentList", "pods": "V1PodList", "leases": "V1LeaseList"}
_API_VERSIONS = {
    "deployments": "apps/v1",
    "pods": "v1",
    "leases": "coordination.k8s.io/v1",
    **NETWORK_API_VERSIONS,
}
# core/v1 Events (the client's model is CoreV1Event, its kind Event).
_GROUPS["events"], _API_VERSIONS["events"] = "", "v1"
_MODELS["events"], _LISTS["events"], _KINDS = "CoreV1Event", "CoreV1EventList", {"events": "Event"}
_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def strategic_merge(target: Any, patch: Any, key: str | None = None) -> Any:
    """The API server's strategic merge for the fields this fake knows; null deletes."""
    if isinstance(patch, dict) and isinstance(target, dict):
        out = dict(target)
        for name, value in patch.items():
            if value is None:
                out.pop(name, None)
            elif name in out:
                out[name] = strategic_merge(out[name], value, name)
            else:
                out[name] = copy.deepcopy(value)
        return out
    merge_key = _MERGE_KEYS.get(key or "")
    if isinstance(patch, list) and isinstance(target, list) and merge_key:
        out_list = [copy.deepcopy(item) for item in target]
        for item in patch:
            index = next(
                (i for i, old in enumerate(out_list) if old.get(merge_key) == item.get(merge_key)),
                None,
            )
            if index is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[index] = strategic_merge(out_list[index], item)
        return out_list
    return copy.deepcopy(patch)


HANG = 0  # a Fault's status: accept the request and never answer (until the fake stops)
HTML = -1  # a Fault's status: answer 200 with an HTML page, as a misrouted proxy does
HTML_PAGE = b"<html><body><h1>Welcome to nginx!</h1></body></html>"


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int  # an HTTP status, HANG or HTML
    times: int


@dataclass
class Request:
    method: str
    path: str
    content_type: str | None
    body: Any


@dataclass
class _Deployment:
    obj: dict[str, Any]
    reads_since_change: int = 0
    pods: list[dict[str, Any]] = field(default_factory=list)
    deleting_reads: int | None = None


class FakeKubernetesApi(NetworkObjects, ServedInThread):
    """The fake's store and behaviour; `host` is what `Configuration(host=...)` takes."""

    def __init__(
        self,
        *,
        pod_ip: str | Callable[[dict[str, Any]], str] = "127.0.0.1",
        rollout_reads: int = 2,
        ready_lists: int = 1,
        delete_reads: int = 1,
    ) -> None:
        self.pod_ip = pod_ip  # one address for every pod, or a function of the pod
        self.rollout_reads = rollout_reads  # reads of a changed Deployment before it settles
        self.ready_lists = ready_lists  # pod lists before a new pod is ready
        self.delete_reads = delete_reads  # reads a foreground deletion takes
        self.deployments: dict[tuple[str, str], _Deployment] = {}
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name)
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.forbidden: set[tuple[str, str]] = set()  # (verb, resource)
        # kvpilot.dev/role label value -> (waiting reason, termination message): crash-looping
        self.crash: dict[str, tuple[str, str]] = {}
        # kvpilot.dev/role label value -> the scheduler's message: its pods stay Pending
        self.unschedulable: dict[str, str] = {}
        self._version = 0
        self._lock = threading.Lock()
        self._unhang = threading.Event()
        self._api = client.ApiClient()
        self._init_network()
        ServedInThread.__init__(self, self._handler())

    # -- lifecycle and test controls -------------------------------------------------------

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api_client(self) -> client.ApiClient:
        return client.ApiClient(client.Configuration(host=self.host))

    def fail(self, method: str, path_regex: str, status: int, times: int = 1) -> None:
        """Answer the next `times` matching requests with `status` (or HANG, or HTML)."""
        self.faults.append(Fault(method, re.compile(path_regex), status, times))

    def hang(self, method: str, path_regex: str, times: int = 1_000_000) -> None:
        """Accept the next `times` matching requests and never answer them."""
        self.fail(method, path_regex, HANG, times)

    def answer_html(self, method: str, path_regex: str, times: int = 1_000_000) -> None:
        """Answer the next `times` matching requests 200 with an HTML page."""
        self.fail(method, path_regex, HTML, times)

    def heal(self) -> None:
        """Drop the faults still pending, and let the hung requests go (they then fail)."""
        with self._lock:
            self.faults.clear()
        self._unhang.set()

    def __exit__(self, *exc: object) -> None:
        self._unhang.set()  # a hung handler thread must not hold up the server's shutdown
        super().__exit__(*exc)

    def forbid(self, verb: str, resource: str) -> None:
        """RBAC says no to `verb` on `resource` (deployments, pods, leases)."""
        self.forbidden.add((verb, resource))

    def add_deployment(self, body: dict[str, Any]) -> dict[str, Any]:
        """Seed a Deployment (validated like a create) whose rollout has completed."""
        with self._lock:
            obj = self._create_deployment(body["metadata"].get("namespace", "default"), body)
            entry = self.deployments[(obj["metadata"]["namespace"], obj["metadata"]["name"])]
            entry.reads_since_change = self.rollout_reads
            self._settle(entry)
            for pod in entry.pods:
                self._make_ready(pod)
            return copy.deepcopy(entry.obj)

    def edit_deployment(self, namespace: str, name: str, change: Callable[[dict], None]) -> None:
        """A person's edit (`kubectl edit`): `change` the spec; a new generation and version."""
        with self._lock:
            entry = self.deployments[(namespace, name)]
            change(entry.obj["spec"])
            meta = entry.obj["metadata"]
            meta["generation"] = int(meta["generation"]) + 1
            meta["resourceVersion"] = self._next_version()

    def restart_containers(self, namespace: str, name: str, container: str = "vllm") -> None:
        """The kubelet restarted `container` in each of the Deployment's pods (a crash and
        a restart between two scrapes): its `restartCount` goes up by one."""
        with self._lock:
            for pod in self.deployments[(namespace, name)].pods:
                for status in pod["status"].get("containerStatuses") or ():
                    if status["name"] == container:
                        status["restartCount"] = int(status.get("restartCount") or 0) + 1

    def take_lease(self, namespace: str, name: str, holder: str) -> None:
        """Another replica takes the Lease over: a new holder and a new resourceVersion."""
        with self._lock:
            lease = self.leases[(namespace, name)]
            lease["spec"]["holderIdentity"] = holder
            lease["metadata"]["resourceVersion"] = self._next_version()

    def update_status(self, namespace: str, name: str) -> None:
        """A controller's status update: a new resourceVersion, the same generation."""
        with self._lock:
            entry = self.deployments[(namespace, name)]
            entry.obj["metadata"]["resourceVersion"] = self._next_version()

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        entry = self.deployments.get((namespace, name))
        return None if entry is None else copy.deepcopy(entry.obj)

    def pods_of(self, namespace: str, name: str) -> list[dict[str, Any]]:
        entry = self.deployments.get((namespace, name))
        return [] if entry is None else copy.deepcopy(entry.pods)

    def writes(self, method: str | None = None) -> list[Request]:
        return [r for r in self.requests if r.method != "GET" and method in (None, r.method)]

    # -- objects ---------------------------------------------------------------------------

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _model_json(self, data: dict[str, Any], model: str) -> dict[str, Any]:
        """Through the client's own model and back: the response the client expects."""
        klass = getattr(client, model)
        return self._api.sanitize_for_serialization(self._api._ApiClient__deserialize(data, klass))

    @staticmethod
    def validate(obj: dict[str, Any]) -> str | None:
        validator = _validator(str(obj.get("apiVersion")), str(obj.get("kind")))
        error = next(iter(validator.iter_errors(obj)), None)  # the one the library raises
        if error is not None:
            path = ".".join(str(p) for p in error.path)
            return f"{obj.get('kind')} is invalid: {path}: {error.message}"
        return None

    def _create_deployment(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", namespace)
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_version(),
            generation=1,
            creationTimestamp=_now(),
        )
        obj["status"] = {}
        entry = _Deployment(obj)
        self.deployments[(namespace, meta["name"])] = entry
        entry.pods = [self._new_pod(entry)]
        return obj

    def _new_pod(self, entry: _Deployment) -> dict[str, Any]:
        template = entry.obj["spec"]["template"]
        name = f"{entry.obj['metadata']['name']}-{uuid.uuid4().hex[:10]}"
        containers = [
            client.V1ContainerStatus(
                name=c["name"],
                image=c.get("image", ""),
                image_id="",
                ready=False,
                restart_count=0,
                started=False,
                state=client.V1ContainerState(
                    waiting=client.V1ContainerStateWaiting(reason="ContainerCreating")
                ),
            )
            for c in template["spec"]["containers"]
        ]
        pod = client.V1Pod(
            api_version="v1",
            kind="Pod",
            metadata=client.V1ObjectMeta(
                name=name,
                namespace=entry.obj["metadata"]["namespace"],
                labels=dict(template["metadata"].get("labels") or {}),
                uid=str(uuid.uuid4()),
            ),
            spec=self._api._ApiClient__deserialize(template["spec"], client.V1PodSpec),
            status=client.V1PodStatus(phase="Pending", container_statuses=containers),
        )
        data = self._api.sanitize_for_serialization(pod)
        data["_lists"] = 0
        return data

    def _make_ready(self, pod: dict[str, Any]) -> None:
        role = pod["metadata"]["labels"].get("kvpilot.dev/role", "")
        if role in self.unschedulable:
            pending = client.V1PodStatus(
                phase="Pending",
                conditions=[
                    client.V1PodCondition(
                        type="PodScheduled",
                        status="False",
                        reason="Unschedulable",
                        message=self.unschedulable[role],
                    )
                ],
            )
            pod["status"] = self._api.sanitize_for_serialization(pending)
            return
        crash = self.crash.get(role)
        statuses = []
        for c in pod["status"]["containerStatuses"]:
            if crash is not None:
                state = client.V1ContainerState(
                    waiting=client.V1ContainerStateWaiting(
                        reason=crash[0], message="back-off restarting failed container"
                    )
                )
                last = client.V1ContainerState(
                    terminated=client.V1ContainerStateTerminated(
                        exit_code=1, reason="Error", message=crash[1]
                    )
                )
            else:
                state = client.V1ContainerState(
                    running=client.V1ContainerStateRunning(started_at=_now())
                )
                last = None
            statuses.append(
                client.V1ContainerStatus(
                    name=c["name"],
                    image=c["image"],
                    image_id="",
                    ready=crash is None,
                    restart_count=0 if crash is None else 3,
                    started=crash is None,
                    state=state,
                    last_state=last,
                )
            )
        ready = "False" if crash is not None else "True"
        status = client.V1PodStatus(
            phase="Running",
            pod_ip=self._pod_ip_of(pod),
            container_statuses=statuses,
            conditions=[client.V1PodCondition(type="Ready", status=ready)],
        )
        pod["status"] = self._api.sanitize_for_serialization(status)

    def _pod_ip_of(self, pod: dict[str, Any]) -> str:
        return self.pod_ip if isinstance(self.pod_ip, str) else self.pod_ip(pod)

    def _settle(self, entry: _Deployment) -> None:
        """A rollout's end: new pods for a changed template, the status caught up."""
        obj = entry.obj
        template = obj["spec"]["template"]
        if any(p["spec"] != self._model_json_pod_spec(template) for p in entry.pods):
            entry.pods = [self._new_pod(entry)]
        replicas = int(obj["spec"].get("replicas", 1))
        ready = sum(1 for p in entry.pods if p.get("_lists", 0) >= self.ready_lists)
        obj["status"] = {
            "observedGeneration": obj["metadata"]["generation"],
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": replicas,
        }

    def _model_json_pod_spec(self, template: dict[str, Any]) -> dict[str, Any]:
        spec = self._api._ApiClient__deserialize(template["spec"], client.V1PodSpec)
        return self._api.sanitize_for_serialization(spec)

    # -- request handling ------------------------------------------------------------------

    def _status(self, code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
        status = client.V1Status(
            api_version="v1",
            kind="Status",
            status="Failure",
            code=code,
            reason=reason,
            message=message,
        )
        return code, self._api.sanitize_for_serialization(status)

    def handle(self, method: str, raw_path: str, ctype: str | None, raw: bytes) -> tuple[int, Any]:
        url = urlparse(raw_path)
        body = json.loads(raw) if raw else None
        with self._lock:
            self.requests.append(Request(method, url.path, ctype, body))
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and fault.path.search(url.path):
                    fault.times -= 1
                    if fault.status in (HANG, HTML):
                        return fault.status, None
                    reason = {403: "Forbidden", 404: "NotFound", 409: "Conflict"}
                    return self._status(
                        fault.status,
                        reason.get(fault.status, "InternalError"),
                        f"injected HTTP {fault.status}",
                    )
            routed = [(p.match(url.path), r) for p, r in _ROUTES if p.match(url.path)]
            if not routed:
                return self._status(404, "NotFound", f"no route {url.path}")
            match, resource = routed[0]
            namespace, name = match.group(1), match.group(2)
            verb = _VERBS[method] if name or method != "GET" else "list"
            if (verb, resource) in self.forbidden:
                group = _GROUPS[resource]
                full = f"{resource}.{group}" if group else resource
                return self._status(
                    403,
                    "Forbidden",
                    (
                        f'{full} "{name or ""}" is forbidden: User "system:serviceaccount:'
                        f'{namespace}:kvpilot" cannot {verb} resource "{resource}" in API group '
                        f'"{group}" in the namespace "{namespace}"'
                    ),
                )
            if isinstance(body, dict) and method in ("POST", "PUT"):
                # The API server takes the type from the URL when the body leaves it out.
                body.setdefault("apiVersion", _API_VERSIONS[resource])
                body.setdefault("kind", _KINDS.get(resource) or _MODELS[resource][2:])
            query = parse_qs(url.query)
            handler = getattr(self, f"_{resource}")
            return handler(verb, namespace, name, ctype, body, query)

    def _deployments(self, verb, namespace, name, ctype, body, query):
        key = (namespace, name)
        if verb == "list":
            items = [
                self._read_deployment(e)
                for (ns, _), e in list(self.deployments.items())
                if ns == namespace
            ]
            items = [i for i in items if i is not None]
            return 200, self._model_json({"items": items, "metadata": {}}, _LISTS["deployments"])
        if verb == "create":
            problem = self.validate(body)
            if problem:
                return self._status(422, "Invalid", problem)
            if (namespace, body["metadata"]["name"]) in self.deployments:
                exists = f'deployments.apps "{body["metadata"]["name"]}" already exists'
                return self._status(409, "AlreadyExists", exists)
            return 201, self._model_json(self._create_deployment(namespace, body), "V1Deployment")
        entry = self.deployments.get(key)
        if entry is None:
            return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        if verb == "get":
            data = self._read_deployment(entry)
            if data is None:
                return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
            return 200, self._model_json(data, "V1Deployment")
        if verb == "patch":
            return self._patch_deployment(entry, ctype, body)
        if verb == "delete":
            policy = (body or {}).get("propagationPolicy")
            entry.obj["metadata"]["deletionTimestamp"] = _now()
            if policy == "Foreground":
                entry.obj["metadata"]["finalizers"] = ["foregroundDeletion"]
            entry.deleting_reads = 0
            self._collect_dependents(entry.obj["metadata"]["uid"])
            return 200, self._model_json(entry.obj, "V1Deployment")
        return self._status(405, "MethodNotAllowed", verb)

    def _collect_dependents(self, uid: str) -> None:
        """The garbage collector: objects owned by `uid` go with their owner."""
        for dependent in self.deployments.values():
            owners = dependent.obj["metadata"].get("ownerReferences") or ()
            if any(o.get("uid") == uid for o in owners) and dependent.deleting_reads is None:
                dependent.deleting_reads = 0
                dependent.obj["metadata"]["deletionTimestamp"] = _now()

    def _read_deployment(self, entry: _Deployment) -> dict[str, Any] | None:
        """One read: deletions and rollouts progress by reads, not by time."""
        meta = entry.obj["metadata"]
        if entry.deleting_reads is not None:
            entry.deleting_reads += 1
            if entry.deleting_reads > self.delete_reads:
                self.deployments.pop((meta["namespace"], meta["name"]), None)
                return None
            return copy.deepcopy(entry.obj)
        entry.reads_since_change += 1
        if entry.reads_since_change >= self.rollout_reads:
            self._settle(entry)
        return copy.deepcopy(entry.obj)

    def _patch_deployment(self, entry, ctype, body):
        if ctype != "application/strategic-merge-patch+json":
            return self._status(415, "UnsupportedMediaType", f"this fake takes no {ctype}")
        meta = entry.obj["metadata"]
        wanted = ((body or {}).get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != meta["resourceVersion"]:
            modified = (
                f'Operation cannot be fulfilled on deployments.apps "{meta["name"]}": the '
                "object has been modified; please apply your changes to the latest version"
            )
            return self._status(409, "Conflict", modified)
        status = entry.obj.get("status")
        merged = strategic_merge({k: v for k, v in entry.obj.items() if k != "status"}, body)
        problem = self.validate(merged)
        if problem:
            return self._status(422, "Invalid", problem)
        if merged["spec"] != entry.obj["spec"]:
            merged["metadata"]["generation"] = int(meta["generation"]) + 1
            entry.reads_since_change = 0
        merged["metadata"]["resourceVersion"] = self._next_version()
        merged["status"] = status
        entry.obj = merged
        return 200, self._model_json(entry.obj, "V1Deployment")

    def _pods(self, verb, namespace, name, ctype, body, query):
        if verb != "list":
            return self._pod_item(verb, namespace, name, ctype, body)
        matches = label_matcher(query.get("labelSelector", [""])[0])
        fields = query.get("fieldSelector", [""])[0]
        only = fields.split("=", 1)[1] if fields.startswith("metadata.name=") else None
        items = []
        for (ns, _), entry in list(self.deployments.items()):
            if ns != namespace or (entry.deleting_reads or 0) > self.delete_reads:
                continue
            for pod in entry.pods:
                labels = pod["metadata"].get("labels") or {}
                if only is not None and pod["metadata"]["name"] != only:
                    continue
                if matches(labels):
                    pod["_lists"] = pod.get("_lists", 0) + 1
                    if pod["_lists"] >= self.ready_lists and not pod["status"].get("podIP"):
                        self._make_ready(pod)
                    items.append({k: v for k, v in pod.items() if k != "_lists"})
        return 200, self._model_json({"items": items, "metadata": {}}, _LISTS["pods"])

    def _leases(self, verb, namespace, name, ctype, body, query):
        key = (namespace, name or (body or {}).get("metadata", {}).get("name"))
        if verb in ("create", "update"):
            problem = self.validate(body)
            if problem:
                return self._status(422, "Invalid", problem)
        if verb == "create":
            if key in self.leases:
                return self._status(409, "AlreadyExists", f'leases "{key[1]}" already exists')
            obj = copy.deepcopy(body)
            obj["metadata"].update(
                namespace=namespace,
                uid=str(uuid.uuid4()),
                resourceVersion=self._next_version(),
                creationTimestamp=_now(),
            )
            self.leases[key] = obj
            return 201, self._model_json(obj, "V1Lease")
        current = self.leases.get(key)
        if current is None:
            return self._status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')
        if verb == "get":
            return 200, self._model_json(current, "V1Lease")
        if verb == "update":
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                return self._status(
                    409,
                    "Conflict",
                    (
                        f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": '
                        "the object has been modified"
                    ),
                )
            obj = copy.deepcopy(body)
            obj["metadata"]["resourceVersion"] = self._next_version()
            self.leases[key] = obj
            return 200, self._model_json(obj, "V1Lease")
        return self._status(405, "MethodNotAllowed", verb)

    def _events(self, verb, namespace, name, ctype, body, query):
        """core/v1 Events: create (validated as the API server does), get, and list with a
        fieldSelector on `involvedObject.*` and `reason`."""
        if verb == "create":
            problem = self.validate(body) or _event_problem(namespace, body)
            if problem:
                return self._status(422, "Invalid", problem)
            key = (namespace, body["metadata"]["name"])
            if key in self.events:
                return self._status(409, "AlreadyExists", f'events "{key[1]}" already exists')
            obj = copy.deepcopy(body)
            obj["metadata"].update(
                namespace=namespace,
                uid=str(uuid.uuid4()),
                resourceVersion=self._next_version(),
                creationTimestamp=_now(),
            )
            self.events[key] = obj
            return 201, self._model_json(obj, "CoreV1Event")
        if verb == "list":
            wanted = dict(
                part.split("=", 1)
                for part in query.get("fieldSelector", [""])[0].split(",")
                if part
            )
            items = [
                e
                for (ns, _), e in self.events.items()
                if ns == namespace and _event_fields_match(e, wanted)
            ]
            return 200, self._model_json({"items": items, "metadata": {}}, "CoreV1EventList")
        found = self.events.get((namespace, name))
        if verb == "get" and found is not None:
            return 200, self._model_json(found, "CoreV1Event")
        if verb == "get":
            return self._status(404, "NotFound", f'events "{name}" not found')
        return self._status(405, "MethodNotAllowed", "this fake creates, gets and lists events")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                ctype = (self.headers.get("Content-Type") or "").split(";")[0] or None
                try:
                    code, payload = fake.handle(self.command, self.path, ctype, raw)
                except Exception as exc:  # a bug in the fake: answer it, the test fails on it
                    code, payload = fake._status(500, "InternalError", f"fake: {exc!r}")
                if code == HANG:
                    fake._unhang.wait(timeout=60)
                    self.close_connection = True  # no answer at all
                    return
                if code == HTML:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(HTML_PAGE)))
                    self.end_headers()
                    self.wfile.write(HTML_PAGE)
                    return
                send_json(self, code, payload)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

            def log_message(self, *args: object) -> None:
                """Quiet: the test reads `fake.requests` instead."""

        return Handler


@functools.cache
def _validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """kubernetes-validate's strict schema for one kind, built once: the library reads its
    JSON schema files again on every call, which a fleet's hundreds of writes cannot afford."""
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{SCHEMA_VERSION}-local-strict"
    try:
        schema = schema_contents(f"{folder}/{kind.lower()}-{group}.json", SCHEMA_VERSION)
    except FileNotFoundError:
        raise kubernetes_validate.SchemaNotFoundError(
            version=SCHEMA_VERSION, kind=kind, api_version=api_version
        ) from None
    definitions = Resource.from_contents(schema_contents(f"{folder}/_definitions.json", ""))
    registry = definitions @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


_SET = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def label_matcher(selector: str) -> Callable[[dict[str, str]], bool]:
    """A label selector as the API server reads it: `k=v`, `k!=v`, `k in (a,b)`,
    `k notin (a,b)`, `k` and `!k`, all of them to hold; "" selects everything."""
    tests: list[Callable[[dict[str, str]], bool]] = []
    for part in re.split(r",(?![^(]*\))", selector):
        part = part.strip()
        if not part:
            continue
        found = _SET.match(part)
        if found is not None:
            key, op, values = found[1], found[2], {v.strip() for v in found[3].split(",")}
            if op == "in":
                tests.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                tests.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif "!=" in part:
            key, value = part.split("!=", 1)
            tests.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "=" in part:
            key, value = part.split("=", 1)
            tests.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif part.startswith("!"):
            tests.append(lambda labels, k=part[1:]: k not in labels)
        else:
            tests.append(lambda labels, k=part: k in labels)
    return lambda labels: all(test(labels) for test in tests)


def _event_problem(namespace: str, event: dict[str, Any]) -> str | None:
    """What the API server's own Event validation refuses beyond the schema."""
    involved = event.get("involvedObject") or {}
    if involved.get("namespace", namespace) != namespace:
        return "Event is invalid: involvedObject.namespace: does not match event.namespace"
    if not event.get("reason") or event.get("type") not in ("Normal", "Warning"):
        return "Event is invalid: reason is required and type is Normal or Warning"
    if not (event.get("source") or {}).get("component") and not event.get("reportingComponent"):
        return "Event is invalid: source.component or reportingComponent is required"
    return None


def _event_fields_match(event: dict[str, Any], wanted: dict[str, str]) -> bool:
    """A fieldSelector of `involvedObject.kind=...,reason=...` pairs, as `kubectl get events`."""
    for path, value in wanted.items():
        node: Any = event
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if str(node) != value:
            return False
    return True
