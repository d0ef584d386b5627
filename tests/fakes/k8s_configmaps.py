"""The fake API server (tests/fakes/k8s_apiserver.py) with core/v1 ConfigMaps besides: create,
get, replace (with the resourceVersion read) and delete, bodies validated as the others are.
A fake: the tests that need ConfigMaps use it; the shared fake stays as it is."""

from __future__ import annotations

import copy
import json
import re
import uuid
from typing import Any
from urllib.parse import urlparse

from tests.fakes.k8s_apiserver import FakeKubernetesApi, Request

_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/configmaps(?:/([^/]+))?$")
_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "DELETE": "delete"}


class FakeApiWithConfigMaps(FakeKubernetesApi):
    """FakeKubernetesApi plus ConfigMaps in `config_maps[(namespace, name)]`."""

    def __init__(self, **kw: Any) -> None:
        self.config_maps: dict[tuple[str, str], dict[str, Any]] = {}
        super().__init__(**kw)

    def handle(self, method: str, raw_path: str, ctype: str | None, raw: bytes) -> tuple[int, Any]:
        url = urlparse(raw_path)
        match = _PATH.match(url.path)
        if match is None or method not in _VERBS:
            return super().handle(method, raw_path, ctype, raw)
        body = json.loads(raw) if raw else None
        namespace, name = match.group(1), match.group(2)
        verb = _VERBS[method]
        with self._lock:
            self.requests.append(Request(method, url.path, ctype, body))
            if (verb, "configmaps") in self.forbidden:
                return self._status(
                    403,
                    "Forbidden",
                    (
                        f'configmaps "{name or ""}" is forbidden: User "system:serviceaccount:'
                        f'{namespace}:kvpilot" cannot {verb} resource "configmaps" in API group "" '
                        f'in the namespace "{namespace}"'
                    ),
                )
            if isinstance(body, dict):
                body.setdefault("apiVersion", "v1")
                body.setdefault("kind", "ConfigMap")
                if problem := self.validate(body):
                    return self._status(422, "Invalid", problem)
            key = (namespace, name or (body or {}).get("metadata", {}).get("name"))
            current = self.config_maps.get(key)
            if verb == "create":
                if current is not None:
                    return self._status(409, "AlreadyExists", f'configmaps "{key[1]}" exists')
                obj = copy.deepcopy(body)
                obj["metadata"].update(
                    namespace=namespace, uid=str(uuid.uuid4()), resourceVersion=self._next_version()
                )
                self.config_maps[key] = obj
                return 201, self._model_json(obj, "V1ConfigMap")
            if current is None:
                return self._status(404, "NotFound", f'configmaps "{name}" not found')
            if verb == "get":
                return 200, self._model_json(current, "V1ConfigMap")
            if verb == "delete":
                del self.config_maps[key]
                status = {
                    "apiVersion": "v1",
                    "kind": "Status",
                    "status": "Success",
                    "details": {"name": key[1], "kind": "configmaps"},
                }
                return 200, self._model_json(status, "V1Status")
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                return self._status(409, "Conflict", f'configmaps "{name}": object modified')
            obj = copy.deepcopy(body)
            obj["metadata"].update(
                namespace=namespace,
                uid=current["metadata"]["uid"],
                resourceVersion=self._next_version(),
            )
            self.config_maps[key] = obj
            return 200, self._model_json(obj, "V1ConfigMap")
