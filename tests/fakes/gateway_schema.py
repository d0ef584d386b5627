"""The Gateway API's published HTTPRoute schema, for validating HTTPRoutes in tests.

The schema is the `openAPIV3Schema` of the Gateway API v1.0.0 CRD (standard channel) as the
npm package `@kubernetes-models/gateway-api` 0.5.1 embeds it in its model file
`gateway.networking.k8s.io/v1/HTTPRoute.js`; `scripts/setup` puts the package under
`.cache/gateway-api/`. Its one `$ref` (ObjectMeta) resolves to the Kubernetes schema that
`kubernetes-validate` ships, and OpenAPI's `nullable` becomes a JSON Schema `null` type.
What the API server checks beyond the schema (CEL rules, defaults) is not checked here.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
MODEL_FILE = ROOT / ".cache/gateway-api/package/gateway.networking.k8s.io/v1/HTTPRoute.js"
_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta#"
_DEFINITIONS_URI = "file:///k8s/_definitions.json"
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


class SchemaMissing(RuntimeError):
    """The package is not in the cache: run ./scripts/setup."""


def _embedded_schema(text: str) -> dict[str, Any]:
    found = re.search(r"^const schema = (\{.*?^\});", text, re.S | re.M)
    if found is None:
        raise SchemaMissing(f"no embedded schema in {MODEL_FILE}")
    return json.loads(found.group(1))


def _openapi_to_jsonschema(node: Any) -> Any:
    """`nullable: true` admits null; the ObjectMeta reference points at Kubernetes' own."""
    if isinstance(node, list):
        return [_openapi_to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _openapi_to_jsonschema(v) for k, v in node.items() if k != "nullable"}
    if out.get("$ref") == _OBJECT_META:
        out["$ref"] = f"{_DEFINITIONS_URI}#/$defs/{_OBJECT_META[:-1]}"
    if node.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _k8s_definitions() -> dict[str, Any]:
    version = kubernetes_validate.latest_version()
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    path = folder / f"v{version}-local-strict" / "_definitions.json"
    return json.loads(path.read_text())


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker()
    for name, (low, high) in _INT_RANGES.items():
        checker.checks(name)(
            lambda value, lo=low, hi=high: not isinstance(value, int) or lo <= value <= hi
        )
    return checker


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    if not MODEL_FILE.is_file():
        raise SchemaMissing(f"{MODEL_FILE} missing: run ./scripts/setup (it fetches the package)")
    schema = _openapi_to_jsonschema(_embedded_schema(MODEL_FILE.read_text()))
    definitions = Resource.from_contents(_k8s_definitions())
    registry = Registry().with_resource(_DEFINITIONS_URI, definitions)
    return jsonschema.Draft202012Validator(
        schema, registry=registry, format_checker=_format_checker()
    )


def httproute_schema() -> dict[str, Any]:
    """The schema as loaded (a copy), for tests that check where it came from."""
    return copy.deepcopy(dict(_validator().schema))


def validate_httproute(body: Any) -> list[str]:
    """The problems with `body` as an HTTPRoute (`path: message`), empty when it is valid."""
    errors = sorted(_validator().iter_errors(body), key=lambda e: list(map(str, e.path)))
    # A oneOf (metadata: ObjectMeta or null) says why by its closest branch.
    errors = [jsonschema.exceptions.best_match(e.context) if e.context else e for e in errors]
    return [f"{_path(e.absolute_path) or '<root>'}: {e.message}" for e in errors]


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out
