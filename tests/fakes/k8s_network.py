"""The fake API server's networking objects: Services, their Endpoints, HTTPRoutes, pods.

Mixed into `FakeKubernetesApi` (tests/fakes/k8s_apiserver.py), whose lock is held around
every handler. Services are core/v1 objects validated with `kubernetes-validate` (strategic
merge, JSON merge and JSON patches); Endpoints are computed on each read from the Service's
selector over the fake's pods, as the endpoints controller would publish them: ready pods
with a podIP and no deletionTimestamp under `addresses`, the others with an IP under
`notReadyAddresses`, named target ports resolved per pod. HTTPRoutes
(gateway.networking.k8s.io/v1) are a CRD: JSON merge and JSON patches only (a strategic
merge answers 415 as the API server does for custom resources), validated with the Gateway
API's published schema (tests/fakes/gateway_schema.py), CEL rules not checked, `status`
kept as written (no status subresource), no controller reporting on them. Single pods
can be read, patched (labels) and deleted: a deleted pod is gone at once (grace period 0)
and its ReplicaSet makes a new one.
"""

from __future__ import annotations

import copy
import re
import uuid
from datetime import UTC, datetime
from typing import Any

from tests.fakes.gateway_schema import validate_httproute

HTTPROUTES = "httproutes.gateway.networking.k8s.io"
_PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json")
_CRD_MEDIA = (
    "the body of the request was in an unknown format - accepted media types include: "
    "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class PatchError(Exception):
    """A JSON patch that does not apply (a failed `test`, a missing path)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge, null deletes, anything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str]) -> tuple[Any, str]:
    node = doc
    for part in parts[:-1]:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise PatchError(f"path /{'/'.join(parts)} not found") from exc
    return node, parts[-1]


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    node, last = _parent(doc, parts)
    try:
        return node[int(last)] if isinstance(node, list) else node[last]
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise PatchError(f"path {path} not found") from exc


def _remove(doc: Any, path: str) -> Any:
    node, last = _parent(doc, _pointer(path))
    _get(doc, path)
    return node.pop(int(last)) if isinstance(node, list) else node.pop(last)


def _add(doc: Any, path: str, value: Any, replace: bool) -> None:
    node, last = _parent(doc, _pointer(path))
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if replace:
            _get(doc, path)
            node[index] = value
        elif 0 <= index <= len(node):
            node.insert(index, value)
        else:
            raise PatchError(f"index {index} out of range at {path}")
    elif isinstance(node, dict):
        if replace and last not in node:
            raise PatchError(f"replace: path {path} not found")
        node[last] = value
    else:
        raise PatchError(f"path {path} not found")


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902 (add, remove, replace, move, copy, test) on a copy of `target`."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch is a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        if kind == "test":
            if _get(doc, path) != op.get("value"):
                raise PatchError(f"testing value {path} failed")
        elif kind == "remove":
            _remove(doc, path)
        elif kind in ("add", "replace"):
            _add(doc, path, copy.deepcopy(op.get("value")), replace=kind == "replace")
        elif kind in ("move", "copy"):
            value = copy.deepcopy(_get(doc, op.get("from", "")))
            if kind == "move":
                _remove(doc, op["from"])
            _add(doc, path, value, replace=False)
        else:
            raise PatchError(f"unknown operation {kind!r}")
    return doc


def selects(selector: dict[str, str] | None, labels: dict[str, str] | None) -> bool:
    """A Service's selector (all of its labels); an empty selector selects nothing here."""
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _target_port(pod: dict[str, Any], port: dict[str, Any]) -> int | None:
    target = port.get("targetPort", port["port"])
    if isinstance(target, int):
        return target
    for container in pod["spec"].get("containers") or ():
        for cport in container.get("ports") or ():
            if cport.get("name") == target:
                return int(cport["containerPort"])
    return None  # the endpoints controller leaves such a pod out of this port


class NetworkObjects:
    """Services, Endpoints, HTTPRoutes and single pods; state set up by `_init_network`."""

    services: dict[tuple[str, str], dict[str, Any]]
    httproutes: dict[tuple[str, str], dict[str, Any]]

    def _init_network(self) -> None:
        self.services = {}
        self.httproutes = {}
        self._cluster_ips = 0

    # -- test controls ---------------------------------------------------------------------

    def add_service(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            code, out = self._services(
                "create", body["metadata"]["namespace"], None, None, copy.deepcopy(body), {}
            )
        assert code == 201, out
        return out

    def add_httproute(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            code, out = self._httproutes(
                "create", body["metadata"]["namespace"], None, None, copy.deepcopy(body), {}
            )
        assert code == 201, out
        return out

    def service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.services.get((namespace, name)))

    def httproute(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.httproutes.get((namespace, name)))

    def endpoints(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            service = self.services.get((namespace, name))
            return None if service is None else self._endpoints_of(service)

    def set_pod_ready(self, namespace: str, pod_name: str, ready: bool) -> None:
        """The kubelet's readiness probe passed (True) or failed (False)."""
        with self._lock:
            _, pod = self._find_pod(namespace, pod_name)
            if pod is None:
                raise KeyError(pod_name)
            if not pod["status"].get("podIP"):
                self._make_ready(pod)
            for condition in pod["status"].get("conditions") or ():
                if condition.get("type") == "Ready":
                    condition["status"] = "True" if ready else "False"

    # -- pods ------------------------------------------------------------------------------

    def _live_pods(self, namespace: str) -> list[dict[str, Any]]:
        entries = [e for (ns, _), e in self.deployments.items() if ns == namespace]
        return [pod for entry in entries if entry.deleting_reads is None for pod in entry.pods]

    def _find_pod(self, namespace: str, name: str) -> tuple[Any, dict[str, Any] | None]:
        for (ns, _), entry in self.deployments.items():
            for pod in entry.pods:
                if ns == namespace and pod["metadata"]["name"] == name:
                    return entry, pod
        return None, None

    def _pod_item(self, verb, namespace, name, ctype, body):
        entry, pod = self._find_pod(namespace, name)
        if pod is None:
            return self._status(404, "NotFound", f'pods "{name}" not found')
        if verb == "get":
            return 200, self._model_json(self._wire_pod(pod), "V1Pod")
        if verb == "delete":
            entry.pods.remove(pod)
            pod["metadata"]["deletionTimestamp"] = _now()
            entry.pods.append(self._new_pod(entry))  # the ReplicaSet replaces it
            return 200, self._model_json(self._wire_pod(pod), "V1Pod")
        if verb != "patch":
            return self._status(405, "MethodNotAllowed", f"this fake does not {verb} a pod")
        merged, problem = self._patched(ctype, self._wire_pod(pod), body, strategic=True)
        if problem:
            return problem
        if merged["spec"] != self._wire_pod(pod)["spec"]:
            return self._status(
                422,
                "Invalid",
                f'Pod "{name}" is invalid: spec: Forbidden: '
                "pod updates may not change fields other than ...",
            )
        invalid = self.validate(merged)
        if invalid:
            return self._status(422, "Invalid", invalid)
        wanted = entry.obj["spec"]["selector"].get("matchLabels") or {}
        if not selects(wanted, merged["metadata"].get("labels")):
            return self._status(
                422,
                "Invalid",
                "this fake does not orphan pods: the patch "
                "takes a label of its ReplicaSet's selector off",
            )
        merged["metadata"]["resourceVersion"] = self._next_version()
        pod["metadata"] = merged["metadata"]
        return 200, self._model_json(self._wire_pod(pod), "V1Pod")

    @staticmethod
    def _wire_pod(pod: dict[str, Any]) -> dict[str, Any]:
        return copy.deepcopy({k: v for k, v in pod.items() if k != "_lists"})

    # -- patches ---------------------------------------------------------------------------

    def _patched(self, ctype, current, body, *, strategic):
        """(the patched object, None) or (None, the error response)."""
        if ctype != "application/json-patch+json" and not isinstance(body, dict):
            return None, self._status(
                400,
                "BadRequest",
                "json: cannot unmarshal array into Go value of type map[string]interface {}",
            )
        try:
            if ctype == "application/json-patch+json":
                merged = json_patch(current, body)
            elif ctype == "application/merge-patch+json":
                merged = merge_patch(current, body)
            elif ctype == "application/strategic-merge-patch+json" and strategic:
                merged = self._strategic(current, body)
            else:
                return None, self._status(415, "UnsupportedMediaType", _CRD_MEDIA)
        except PatchError as exc:
            return None, self._status(422, "Invalid", f"the server rejected our request: {exc}")
        wanted = ((body or {}).get("metadata") or {}) if isinstance(body, dict) else {}
        version = wanted.get("resourceVersion") or merged["metadata"].get("resourceVersion")
        if version != current["metadata"].get("resourceVersion"):
            return None, self._status(
                409,
                "Conflict",
                (
                    f"Operation cannot be fulfilled on {current['kind']} "
                    f'"{current["metadata"]["name"]}": the object has been modified; please apply '
                    "your changes to the latest version and try again"
                ),
            )
        return merged, None

    def _strategic(self, current, body):
        """Service ports merge by `port` (their patch merge key), the rest as the fake does."""
        from tests.fakes.k8s_apiserver import strategic_merge  # the module that mixes this in

        ports = ((body or {}).get("spec") or {}).get("ports")
        merged = strategic_merge(current, body)
        if ports is not None and current.get("kind") == "Service":
            old = {p["port"]: p for p in (current.get("spec") or {}).get("ports") or ()}
            for port in ports:
                old[port["port"]] = merge_patch(old.get(port["port"], {}), port)
            merged["spec"]["ports"] = list(old.values())
        return merged

    # -- Services and Endpoints ------------------------------------------------------------

    def _stamp(self, obj: dict[str, Any], namespace: str) -> None:
        meta = obj.setdefault("metadata", {})
        meta.update(
            namespace=namespace,
            uid=str(uuid.uuid4()),
            generation=1,
            resourceVersion=self._next_version(),
            creationTimestamp=_now(),
        )

    def _services(self, verb, namespace, name, ctype, body, query):
        if verb == "list":
            items = [s for (ns, _), s in self.services.items() if ns == namespace]
            return 200, self._model_json({"items": items, "metadata": {}}, "V1ServiceList")
        if verb == "create":
            problem = self.validate(body)
            if problem:
                return self._status(422, "Invalid", problem)
            key = (namespace, body["metadata"]["name"])
            if key in self.services:
                return self._status(409, "AlreadyExists", f'services "{key[1]}" already exists')
            self._stamp(body, namespace)
            self._cluster_ips += 1
            body.setdefault("spec", {})
            body["spec"].setdefault("clusterIP", f"10.96.0.{self._cluster_ips}")
            body["spec"].setdefault("type", "ClusterIP")
            self.services[key] = body
            return 201, self._model_json(body, "V1Service")
        current = self.services.get((namespace, name))
        if current is None:
            return self._status(404, "NotFound", f'services "{name}" not found')
        if verb == "get":
            return 200, self._model_json(current, "V1Service")
        if verb == "delete":
            del self.services[(namespace, name)]
            return 200, self._model_json(current, "V1Service")
        if verb == "update":
            merged = copy.deepcopy(body)
            if merged["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                return self._status(
                    409, "Conflict", f'services "{name}": the object has been modified'
                )
        elif verb == "patch":
            merged, error = self._patched(ctype, current, body, strategic=True)
            if error:
                return error
        else:
            return self._status(405, "MethodNotAllowed", verb)
        problem = self.validate(merged)
        if problem:
            return self._status(422, "Invalid", problem)
        merged["metadata"]["resourceVersion"] = self._next_version()
        self.services[(namespace, name)] = merged
        return 200, self._model_json(merged, "V1Service")

    def _endpoints_of(self, service: dict[str, Any]) -> dict[str, Any]:
        meta = service["metadata"]
        ports = service["spec"].get("ports") or ()
        groups: dict[tuple[tuple[str | None, int], ...], dict[str, list[Any]]] = {}
        for pod in self._live_pods(meta["namespace"]):
            ip = pod["status"].get("podIP")
            if not selects(service["spec"].get("selector"), pod["metadata"].get("labels")):
                continue
            if not ip or pod["metadata"].get("deletionTimestamp"):
                continue
            resolved = tuple((p.get("name"), _target_port(pod, p)) for p in ports)
            resolved = tuple((n, port) for n, port in resolved if port is not None)
            group = groups.setdefault(resolved, {"addresses": [], "notReadyAddresses": []})
            address = {
                "ip": ip,
                "targetRef": {
                    "kind": "Pod",
                    "name": pod["metadata"]["name"],
                    "namespace": meta["namespace"],
                    "uid": pod["metadata"]["uid"],
                },
            }
            group["addresses" if _ready(pod) else "notReadyAddresses"].append(address)
        subsets = []
        for resolved, group in groups.items():
            subset = {k: v for k, v in group.items() if v}
            subset["ports"] = [{"name": n, "port": p, "protocol": "TCP"} for n, p in resolved]
            subsets.append(subset)
        body = {
            "apiVersion": "v1",
            "kind": "Endpoints",
            "subsets": subsets or None,
            "metadata": {
                "name": meta["name"],
                "namespace": meta["namespace"],
                "labels": meta.get("labels"),
            },
        }
        return self._model_json(body, "V1Endpoints")

    def _endpoints(self, verb, namespace, name, ctype, body, query):
        if verb == "list":
            items = [
                self._endpoints_of(s)
                for (ns, _), s in self.services.items()
                if ns == namespace and s["spec"].get("selector")
            ]
            return 200, self._model_json({"items": items, "metadata": {}}, "V1EndpointsList")
        if verb != "get":
            return self._status(405, "MethodNotAllowed", "the endpoints controller owns these")
        service = self.services.get((namespace, name))
        if service is None or not service["spec"].get("selector"):
            return self._status(404, "NotFound", f'endpoints "{name}" not found')
        return 200, self._endpoints_of(service)

    # -- HTTPRoutes ------------------------------------------------------------------------

    def _route_problem(self, obj: dict[str, Any]) -> tuple[int, Any] | None:
        problems = validate_httproute(obj)
        if not problems:
            return None
        name = (obj.get("metadata") or {}).get("name", "")
        return self._status(
            422,
            "Invalid",
            f'HTTPRoute.gateway.networking.k8s.io "{name}" is invalid: {"; ".join(problems)}',
        )

    def _httproutes(self, verb, namespace, name, ctype, body, query):
        if verb == "list":
            items = [r for (ns, _), r in self.httproutes.items() if ns == namespace]
            return 200, {
                "apiVersion": "gateway.networking.k8s.io/v1",
                "kind": "HTTPRouteList",
                "items": copy.deepcopy(items),
                "metadata": {},
            }
        if verb == "create":
            problem = self._route_problem(body)
            if problem:
                return problem
            key = (namespace, body["metadata"]["name"])
            if key in self.httproutes:
                return self._status(409, "AlreadyExists", f'{HTTPROUTES} "{key[1]}" already exists')
            self._stamp(body, namespace)
            self.httproutes[key] = body
            return 201, copy.deepcopy(body)
        current = self.httproutes.get((namespace, name))
        if current is None:
            return self._status(404, "NotFound", f'{HTTPROUTES} "{name}" not found')
        if verb == "get":
            return 200, copy.deepcopy(current)
        if verb == "delete":
            del self.httproutes[(namespace, name)]
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        if verb == "update":
            merged = copy.deepcopy(body)
            if merged["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                return self._status(
                    409, "Conflict", f'{HTTPROUTES} "{name}": the object has been modified'
                )
        elif verb == "patch":
            merged, error = self._patched(ctype, current, body, strategic=False)
            if error:
                return error
        else:
            return self._status(405, "MethodNotAllowed", verb)
        problem = self._route_problem(merged)
        if problem:
            return problem
        if merged.get("spec") != current.get("spec"):
            merged["metadata"]["generation"] = int(current["metadata"]["generation"]) + 1
        merged["metadata"]["resourceVersion"] = self._next_version()
        self.httproutes[(namespace, name)] = merged
        return 200, copy.deepcopy(merged)


NETWORK_ROUTES = [
    (re.compile(r"^/api/v1/namespaces/([^/]+)/services(?:/([^/]+))?$"), "services"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/endpoints(?:/([^/]+))?$"), "endpoints"),
    (
        re.compile(
            r"^/apis/gateway.networking.k8s.io/v1/namespaces/([^/]+)/httproutes(?:/([^/]+))?$"
        ),
        "httproutes",
    ),
]
NETWORK_GROUPS = {"services": "", "endpoints": "", "httproutes": "gateway.networking.k8s.io"}
NETWORK_KINDS = {"services": "V1Service", "endpoints": "V1Endpoints", "httproutes": "V1HTTPRoute"}
NETWORK_API_VERSIONS = {
    "services": "v1",
    "endpoints": "v1",
    "httproutes": "gateway.networking.k8s.io/v1",
}
