"""The fake API server (tests/fakes/k8s_apiserver.py, with ConfigMaps) for a fleet: a
Deployment of several replicas whose pods a ReplicaSet controls (ownerReferences as the
Deployment controller writes them), ReplicaSets (get), PodDisruptionBudgets (get, list; their
`status.disruptionsAllowed` computed from the ready pods they select, as the disruption
controller does), and the `pods/eviction` subresource: 429 when a PDB forbids, else the pod
goes and the ReplicaSet's replacement comes, ready after `ready_lists` lists like any pod.
A fake, named as such: no scheduler, no kubelet, no watch.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from typing import Any
from urllib.parse import urlparse

from tests.fakes.k8s_apiserver import Request, _Deployment
from tests.fakes.k8s_configmaps import FakeApiWithConfigMaps

_EVICTION = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction$")
_REPLICA_SETS = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/replicasets/([^/]+)$")
_PDBS = re.compile(r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets(?:/([^/]+))?$")


class FakeFleetApi(FakeApiWithConfigMaps):
    """FakeApiWithConfigMaps whose Deployments have `spec.replicas` pods, with PDBs and
    evictions; `evictions` lists the pods evicted, `replaced` maps each to its successor."""

    def __init__(self, **kw: Any) -> None:
        self.replica_sets: dict[tuple[str, str], dict[str, Any]] = {}
        self.pdbs: dict[tuple[str, str], dict[str, Any]] = {}
        self.evictions: list[str] = []
        self.replaced: dict[str, str] = {}
        super().__init__(**kw)

    # -- seeding ---------------------------------------------------------------------------

    def add_deployment(self, body: dict[str, Any]) -> dict[str, Any]:
        obj = super().add_deployment(body)
        with self._lock:
            entry = self.deployments[(obj["metadata"]["namespace"], obj["metadata"]["name"])]
            while len(entry.pods) < int(obj["spec"].get("replicas", 1)):
                pod = self._new_pod(entry)
                self._make_ready(pod)
                entry.pods.append(pod)
            return copy.deepcopy(entry.obj)

    def add_pdb(self, namespace: str, name: str, selector: dict[str, Any], **spec: Any) -> None:
        """A PodDisruptionBudget (`minAvailable` or `maxUnavailable` in `spec`)."""
        body = {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())},
            "spec": {"selector": selector, **spec},
        }
        assert self.validate(body) is None, self.validate(body)
        with self._lock:
            self.pdbs[(namespace, name)] = body

    def _replica_set_of(self, entry: _Deployment) -> dict[str, Any]:
        meta = entry.obj["metadata"]
        key = (meta["namespace"], f"{meta['name']}-{meta['uid'][:8]}")
        if key not in self.replica_sets:
            self.replica_sets[key] = {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {
                    "name": key[1],
                    "namespace": key[0],
                    "uid": str(uuid.uuid4()),
                    "ownerReferences": [_owner("apps/v1", "Deployment", meta)],
                },
                "spec": {
                    "selector": entry.obj["spec"]["selector"],
                    "template": entry.obj["spec"]["template"],
                },
            }
        return self.replica_sets[key]

    def _new_pod(self, entry: _Deployment) -> dict[str, Any]:
        pod = super()._new_pod(entry)
        replica_set = self._replica_set_of(entry)["metadata"]
        pod["metadata"]["ownerReferences"] = [_owner("apps/v1", "ReplicaSet", replica_set)]
        return pod

    # -- requests --------------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, ctype: str | None, raw: bytes) -> tuple[int, Any]:
        path = urlparse(raw_path).path
        for pattern, handler in (
            (_EVICTION, self._evict),
            (_REPLICA_SETS, self._replica_set),
            (_PDBS, self._pdb),
        ):
            match = pattern.match(path)
            if match is None:
                continue
            body = json.loads(raw) if raw else None
            with self._lock:
                self.requests.append(Request(method, path, ctype, body))
                return handler(method, match.group(1), match.group(2), body)
        return super().handle(method, raw_path, ctype, raw)

    def _replica_set(self, method: str, namespace: str, name: str, body: Any) -> tuple[int, Any]:
        found = self.replica_sets.get((namespace, name))
        if method != "GET" or found is None:
            return self._status(404, "NotFound", f'replicasets.apps "{name}" not found')
        return 200, self._model_json(found, "V1ReplicaSet")

    def _pods_selected(self, namespace: str, selector: dict[str, Any]) -> list[dict[str, Any]]:
        wanted = selector.get("matchLabels") or {}
        return [
            pod
            for (ns, _), entry in self.deployments.items()
            if ns == namespace
            for pod in entry.pods
            if all((pod["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())
        ]

    def _with_status(self, pdb: dict[str, Any]) -> dict[str, Any]:
        namespace = pdb["metadata"]["namespace"]
        pods = self._pods_selected(namespace, pdb["spec"]["selector"])
        healthy = sum(1 for p in pods if _ready(p))
        spec = pdb["spec"]
        if "minAvailable" in spec:
            desired = int(spec["minAvailable"])
        else:
            desired = len(pods) - int(spec.get("maxUnavailable", 0))
        out = copy.deepcopy(pdb)
        out["status"] = {
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "expectedPods": len(pods),
            "disruptionsAllowed": max(0, healthy - desired),
            "observedGeneration": 1,
        }
        return out

    def _pdb(self, method: str, namespace: str, name: str | None, body: Any) -> tuple[int, Any]:
        if method != "GET":
            return self._status(405, "MethodNotAllowed", "this fake reads PDBs only")
        if name is None:
            items = [self._with_status(p) for (ns, _), p in self.pdbs.items() if ns == namespace]
            payload = {"items": items, "metadata": {}}
            return 200, self._model_json(payload, "V1PodDisruptionBudgetList")
        found = self.pdbs.get((namespace, name))
        if found is None:
            return self._status(404, "NotFound", f'poddisruptionbudgets.policy "{name}" not found')
        return 200, self._model_json(self._with_status(found), "V1PodDisruptionBudget")

    def _evict(self, method: str, namespace: str, name: str, body: Any) -> tuple[int, Any]:
        if method != "POST":
            return self._status(405, "MethodNotAllowed", "evictions are created")
        if ("create", "pods/eviction") in self.forbidden:
            return self._status(403, "Forbidden", "cannot create resource pods/eviction")
        owner = next(
            (
                e
                for (ns, _), e in self.deployments.items()
                if ns == namespace
                for p in e.pods
                if p["metadata"]["name"] == name
            ),
            None,
        )
        if owner is None:
            return self._status(404, "NotFound", f'pods "{name}" not found')
        pod = next(p for p in owner.pods if p["metadata"]["name"] == name)
        for pdb in (p for (ns, _), p in self.pdbs.items() if ns == namespace):
            labels = pod["metadata"].get("labels") or {}
            wanted = pdb["spec"]["selector"].get("matchLabels") or {}
            chosen = all(labels.get(k) == v for k, v in wanted.items())
            if chosen and self._with_status(pdb)["status"]["disruptionsAllowed"] < 1:
                return self._status(
                    429,
                    "TooManyRequests",
                    "Cannot evict pod as it would violate the pod's disruption budget.",
                )
        owner.pods.remove(pod)
        successor = self._new_pod(owner)
        owner.pods.append(successor)
        self.evictions.append(name)
        self.replaced[name] = successor["metadata"]["name"]
        status = {"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 201}
        return 201, self._model_json(status, "V1Status")


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _owner(api_version: str, kind: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
