"""A promotion handed over in a ConfigMap, for Deployments of several replicas.

With one replica the state directory is a PersistentVolumeClaim and the next pod finds the
rollout where the last one left it. Several replicas cannot share one claim, so the Lease
holder that is replaced mid-promotion writes the rollout's record and its trial into the
ConfigMap `<deployment>-kvpilot-handover`, and whichever pod takes the Lease next imports
them and resumes the bake. Its data are two JSON documents, secrets masked as the state
database keeps them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.agent.runtimes.kubernetes.api import Conflict, NotFound, call, client_module
from kvpilot.collectors.secrets import mask

RESOURCE = "configmaps"
SUFFIX = "-kvpilot-handover"
ROLLOUT_KEY = "rollout.json"
TRIAL_KEY = "trial.json"


def handover_name(deployment: str) -> str:
    return f"{deployment}{SUFFIX}"


def data_digest(data: Mapping[str, str]) -> str:
    """The SHA-256 of a handover's data, as its writer vouches for it in the Lease."""
    return hashlib.sha256(json.dumps(dict(data), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class HandedOver:
    """A handover as read: the rollout record and trial (dicts), and its data's digest."""

    rollout: dict[str, Any]
    trial: dict[str, Any] | None
    digest: str


class HandoverConfigMap:
    """Write, read and delete the handover ConfigMap of one Deployment (synchronous: call
    it from a worker thread, or while kvpilot is stopping)."""

    def __init__(self, api_client: Any, *, namespace: str, deployment: str) -> None:
        self._core = client_module().CoreV1Api(api_client)
        self.namespace = namespace
        self.deployment = deployment
        self.name = handover_name(deployment)

    def _what(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    def _body(self, data: dict[str, str], version: str | None = None) -> Any:
        client = client_module()
        meta = client.V1ObjectMeta(
            name=self.name,
            namespace=self.namespace,
            resource_version=version,
            labels={
                "app.kubernetes.io/managed-by": "kvpilot",
                "kvpilot.dev/deployment": self.deployment,
            },
        )
        return client.V1ConfigMap(api_version="v1", kind="ConfigMap", metadata=meta, data=data)

    def put(self, rollout: dict[str, Any], trial: dict[str, Any] | None) -> str:
        """Create or replace the handover with this rollout record and trial (as dicts);
        returns its data's digest."""
        data = {ROLLOUT_KEY: json.dumps(mask(rollout), sort_keys=True)}
        if trial is not None:
            data[TRIAL_KEY] = json.dumps(mask(trial), sort_keys=True)
        current = self._read()
        if current is None:
            try:
                call(
                    self._core.create_namespaced_config_map,
                    self.namespace,
                    self._body(data),
                    verb="create",
                    resource=RESOURCE,
                    what=self._what(),
                )
                return data_digest(data)
            except Conflict:
                current = self._read()  # created meanwhile: replace it below
        version = None if current is None else current.metadata.resource_version
        call(
            self._core.replace_namespaced_config_map,
            self.name,
            self.namespace,
            self._body(data, version),
            verb="update",
            resource=RESOURCE,
            what=self._what(),
        )
        return data_digest(data)

    def _read(self) -> Any | None:
        try:
            return call(
                self._core.read_namespaced_config_map,
                self.name,
                self.namespace,
                verb="get",
                resource=RESOURCE,
                what=self._what(),
            )
        except NotFound:
            return None

    def get(self) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """The rollout record and trial handed over (as dicts), or None when there is none
        or it cannot be read as one (a malformed handover is not resumed)."""
        found = self.read()
        return None if found is None else (found.rollout, found.trial)

    def read(self) -> HandedOver | None:
        """The handover with its digest, or None (none, or not one: not resumed)."""
        found = self._read()
        data = (found.data or {}) if found is not None else {}
        if ROLLOUT_KEY not in data:
            return None
        try:
            rollout = json.loads(data[ROLLOUT_KEY])
            trial = json.loads(data[TRIAL_KEY]) if TRIAL_KEY in data else None
        except ValueError:
            return None
        if not isinstance(rollout, dict) or not (trial is None or isinstance(trial, dict)):
            return None
        return HandedOver(rollout, trial, data_digest(data))

    def delete(self) -> None:
        with contextlib.suppress(NotFound):  # already gone
            call(
                self._core.delete_namespaced_config_map,
                self.name,
                self.namespace,
                verb="delete",
                resource=RESOURCE,
                what=self._what(),
            )
