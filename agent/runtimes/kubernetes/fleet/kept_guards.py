"""What must outlive a pod, kept per Deployment: each pod's restarts and breaker, and the
last decisions, in the ConfigMap `<deployment>-kvpilot-guards`.

A pod's SQLite lives on an emptyDir and goes with the pod; a replica that replaces it (an
eviction, a node drain, a rolling update) adopts the record of one pod that is gone, so the
restarts it made still count against the budget and an open breaker stays open. Bounded in
size (MAX_PODS records of MAX_RESTARTS stamps, the last MAX_DECISIONS decisions, messages cut
at MAX_TEXT) and in write rate: a write follows a restart, which the guards already bound.
Every write carries the resourceVersion read; a conflict is read again. Blocking calls.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from kvpilot.agent.runtimes.kubernetes.api import Conflict, NotFound, call, client_module

RESOURCE = "configmaps"
SUFFIX = "-kvpilot-guards"
KEY = "guards.json"
MAX_PODS, MAX_RESTARTS, MAX_DECISIONS, MAX_TEXT = 64, 20, 20, 200
TRIES = 5


@dataclass(frozen=True, slots=True)
class PodRecord:
    """One pod's guards as its Deployment remembers them (stamps in wall seconds)."""

    restarts_wall_s: tuple[float, ...] = ()
    breaker: dict[str, Any] = field(default_factory=dict)


def kept_guards_name(deployment: str) -> str:
    return f"{deployment}{SUFFIX}"


class KeptGuards:
    """Read, adopt and write the ConfigMap of the guards a Deployment keeps."""

    def __init__(self, api_client: Any, *, namespace: str, deployment: str) -> None:
        self._core = client_module().CoreV1Api(api_client)
        self.namespace = namespace
        self.deployment = deployment
        self.name = kept_guards_name(deployment)

    def _what(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    def _read(self) -> tuple[Any | None, dict[str, Any]]:
        try:
            found = call(
                self._core.read_namespaced_config_map,
                self.name,
                self.namespace,
                verb="get",
                resource=RESOURCE,
                what=self._what(),
            )
        except NotFound:
            return None, {"pods": {}, "decisions": []}
        try:
            doc = json.loads((found.data or {}).get(KEY) or "{}")
        except json.JSONDecodeError:
            doc = {}  # hand-edited into nonsense: start again rather than stop restarting
        doc = doc if isinstance(doc, dict) else {}
        doc.setdefault("pods", {})
        doc.setdefault("decisions", [])
        return found, doc

    def _write(self, found: Any | None, doc: dict[str, Any]) -> None:
        client = client_module()
        data = {KEY: json.dumps(_bounded(doc), sort_keys=True)}
        if found is None:
            meta = client.V1ObjectMeta(
                name=self.name,
                namespace=self.namespace,
                labels={
                    "app.kubernetes.io/managed-by": "kvpilot",
                    "kvpilot.dev/deployment": self.deployment,
                },
            )
            body = client.V1ConfigMap(api_version="v1", kind="ConfigMap", metadata=meta, data=data)
            call(
                self._core.create_namespaced_config_map,
                self.namespace,
                body,
                verb="create",
                resource=RESOURCE,
                what=self._what(),
            )
            return
        found.data = data
        call(
            self._core.replace_namespaced_config_map,
            self.name,
            self.namespace,
            found,
            verb="update",
            resource=RESOURCE,
            what=self._what(),
        )

    def _change(self, edit: Any) -> Any:
        """Read, `edit(doc)` (its answer returned), write; again on a conflict."""
        for _ in range(TRIES):
            found, doc = self._read()
            answer, changed = edit(doc)
            if not changed:
                return answer
            try:
                self._write(found, doc)
            except Conflict:
                continue
            return answer
        raise Conflict(f"{self._what()} kept changing under {TRIES} writes", 409)

    def record(self, pod: str) -> PodRecord:
        found = self._read()[1]["pods"].get(pod) or {}
        return PodRecord(
            tuple(found.get("restarts_wall_s") or ()), dict(found.get("breaker") or {})
        )

    def adopt(self, pod: str, alive: Collection[str]) -> PodRecord:
        """This pod's record; a new pod takes over the latest record of a pod that is gone
        (one successor per departed pod: the record moves, it is not copied)."""

        def edit(doc: dict[str, Any]) -> tuple[PodRecord, bool]:
            pods = doc["pods"]
            if pod in pods:
                return _record(pods[pod]), False
            gone = [name for name in pods if name not in alive]
            if not gone:
                return PodRecord(), False
            latest = max(gone, key=lambda name: max(pods[name].get("restarts_wall_s") or [0]))
            pods[pod] = {**pods.pop(latest), "adopted_from": latest}
            return _record(pods[pod]), True

        adopted: PodRecord = self._change(edit)
        return adopted

    def note(
        self,
        pod: str,
        *,
        restart_wall_s: float | None,
        breaker: dict[str, Any] | None,
        decision: dict[str, Any] | None,
    ) -> None:
        """Add a restart, the breaker's facts and a decision to the guards the Deployment keeps."""

        def edit(doc: dict[str, Any]) -> tuple[None, bool]:
            mine = doc["pods"].setdefault(pod, {})
            if restart_wall_s is not None:
                mine["restarts_wall_s"] = [*(mine.get("restarts_wall_s") or ()), restart_wall_s]
            if breaker is not None:
                mine["breaker"] = breaker
            if decision is not None:
                doc["decisions"].append({k: _cut(v) for k, v in decision.items()})
            return None, True

        self._change(edit)

    def decisions(self) -> list[dict[str, Any]]:
        return list(self._read()[1]["decisions"])


def _record(raw: dict[str, Any]) -> PodRecord:
    return PodRecord(tuple(raw.get("restarts_wall_s") or ()), dict(raw.get("breaker") or {}))


def _cut(value: Any) -> Any:
    return value[:MAX_TEXT] if isinstance(value, str) else value


def _bounded(doc: dict[str, Any]) -> dict[str, Any]:
    pods = {
        name: {**raw, "restarts_wall_s": list(raw.get("restarts_wall_s") or ())[-MAX_RESTARTS:]}
        for name, raw in doc["pods"].items()
    }
    newest = sorted(pods, key=lambda n: max(pods[n]["restarts_wall_s"] or [0]), reverse=True)
    return {
        "pods": {name: pods[name] for name in newest[:MAX_PODS]},
        "decisions": doc["decisions"][-MAX_DECISIONS:],
    }
