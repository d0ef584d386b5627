"""What must outlive a pod, kept per Deployment: each pod's restarts and breaker, the last
decisions and the operators' vetoes (key `guards.json`), and the learned workload's summary
(key `workload.json`), in the ConfigMap `<deployment>-kvpilot-guards`.

A pod's SQLite lives on an emptyDir and goes with the pod; a replica that replaces it (an
eviction, a node drain, a rolling update) adopts the record of one pod that is gone, so the
restarts it made still count against the budget and an open breaker stays open. Bounded in
size (MAX_PODS records of MAX_RESTARTS stamps, the last MAX_DECISIONS decisions, messages cut
at MAX_TEXT, MAX_VETOES vetoes, expired ones dropped on every write, a workload summary of at
most MAX_WORKLOAD_CHARS) and in write rate: a write follows a restart, which the guards
already bound, an operator's veto or lift, or a changed workload summary (its writer bounds
it). Every write carries the resourceVersion read; a conflict is read again. Blocking calls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from kvpilot.agent.runtimes.kubernetes.api import Conflict, NotFound, call, client_module

RESOURCE = "configmaps"
SUFFIX = "-kvpilot-guards"
KEY = "guards.json"
WORKLOAD_KEY = "workload.json"
MAX_PODS, MAX_RESTARTS, MAX_DECISIONS, MAX_TEXT = 64, 20, 20, 200
MAX_VETOES = 32
MAX_WORKLOAD_CHARS = 32_000  # two length histograms of vLLM's buckets take about 2,000
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

    def __init__(
        self,
        api_client: Any,
        *,
        namespace: str,
        deployment: str,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._core = client_module().CoreV1Api(api_client)
        self.namespace = namespace
        self.deployment = deployment
        self.name = kept_guards_name(deployment)
        self._wall_clock = wall_clock  # only to drop the vetoes that have ended

    def _what(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    def _read_data(self) -> tuple[Any | None, dict[str, str]]:
        """(the ConfigMap or None, its data): every key, so a write keeps the others."""
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
            return None, {}
        return found, dict(found.data or {})

    def _read(self) -> tuple[Any | None, dict[str, Any]]:
        found, data = self._read_data()
        return found, _guards_doc(data.get(KEY))

    def _write_data(self, found: Any | None, data: dict[str, str]) -> None:
        client = client_module()
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

        def edit_data(data: dict[str, str]) -> tuple[Any, bool]:
            doc = _guards_doc(data.get(KEY))
            answer, changed = edit(doc)
            if changed:
                data[KEY] = json.dumps(_bounded(doc, self._wall_clock()), sort_keys=True)
            return answer, changed

        return self._change_data(edit_data)

    def _change_data(self, edit: Any) -> Any:
        """Read, `edit(data)` (its answer returned), write; again on a conflict."""
        for _ in range(TRIES):
            found, data = self._read_data()
            answer, changed = edit(data)
            if not changed:
                return answer
            try:
                self._write_data(found, data)
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

    # -- the operators' vetoes: facts of the Deployment, whichever replica set them -------

    def vetoes(self) -> list[dict[str, Any]]:
        """The vetoes in force (rows as the remediator saves them), ended ones left out."""
        return _in_force(self._read()[1]["vetoes"], self._wall_clock())

    def put_veto(self, row: dict[str, Any]) -> None:
        """Keep one veto (a row with `kind` and `target`), replacing one of the same target."""

        def edit(doc: dict[str, Any]) -> tuple[None, bool]:
            others = [v for v in doc["vetoes"] if _veto_key(v) != _veto_key(row)]
            doc["vetoes"] = [*others, {k: _cut(v) for k, v in row.items()}]
            return None, True

        self._change(edit)

    def lift_veto(self, kind: str, target: str) -> bool:
        """Drop the veto of `kind` `target`; False when none was kept."""

        def edit(doc: dict[str, Any]) -> tuple[bool, bool]:
            kept = [v for v in doc["vetoes"] if _veto_key(v) != (kind, target)]
            lifted = len(kept) < len(doc["vetoes"])
            doc["vetoes"] = kept
            return lifted, lifted

        lifted: bool = self._change(edit)
        return lifted

    # -- the learned workload: the summary the tuner replays, not the raw samples ----------

    def workload(self) -> dict[str, Any] | None:
        """The workload summary a replica kept last, or None (none, or not JSON)."""
        raw = self._read_data()[1].get(WORKLOAD_KEY)
        try:
            found = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return None
        return found if isinstance(found, dict) else None

    def keep_workload(self, summary: dict[str, Any]) -> None:
        """Keep `summary` as the Deployment's learned workload (ValueError when too large)."""
        text = json.dumps(summary, sort_keys=True)
        if len(text) > MAX_WORKLOAD_CHARS:
            raise ValueError(
                f"the workload summary takes {len(text)} characters, above {MAX_WORKLOAD_CHARS}"
            )

        def edit(data: dict[str, str]) -> tuple[None, bool]:
            changed = data.get(WORKLOAD_KEY) != text
            data[WORKLOAD_KEY] = text
            return None, changed

        self._change_data(edit)


def _guards_doc(raw: str | None) -> dict[str, Any]:
    try:
        doc = json.loads(raw or "{}")
    except json.JSONDecodeError:
        doc = {}  # hand-edited into nonsense: start again rather than stop restarting
    doc = doc if isinstance(doc, dict) else {}
    for key in ("pods", "decisions", "vetoes"):
        if not isinstance(doc.get(key), dict if key == "pods" else list):
            doc[key] = {} if key == "pods" else []
    return doc


def _record(raw: dict[str, Any]) -> PodRecord:
    return PodRecord(tuple(raw.get("restarts_wall_s") or ()), dict(raw.get("breaker") or {}))


def _cut(value: Any) -> Any:
    return value[:MAX_TEXT] if isinstance(value, str) else value


def _veto_key(row: Any) -> tuple[str, str] | None:
    if not isinstance(row, dict):
        return None
    return str(row.get("kind")), str(row.get("target"))


def _in_force(rows: list[Any], now_wall_s: float) -> list[dict[str, Any]]:
    """The veto rows that have not ended by `now_wall_s` (a row not a dict is dropped)."""
    kept = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        until = row.get("until_wall_s")
        if isinstance(until, int | float) and not isinstance(until, bool) and until <= now_wall_s:
            continue
        kept.append(row)
    return kept


def _bounded(doc: dict[str, Any], now_wall_s: float) -> dict[str, Any]:
    pods = {
        name: {**raw, "restarts_wall_s": list(raw.get("restarts_wall_s") or ())[-MAX_RESTARTS:]}
        for name, raw in doc["pods"].items()
    }
    newest = sorted(pods, key=lambda n: max(pods[n]["restarts_wall_s"] or [0]), reverse=True)
    return {
        "pods": {name: pods[name] for name in newest[:MAX_PODS]},
        "decisions": doc["decisions"][-MAX_DECISIONS:],
        # The latest vetoes win the room: an operator's newest word matters most.
        "vetoes": _in_force(doc["vetoes"], now_wall_s)[-MAX_VETOES:],
    }
