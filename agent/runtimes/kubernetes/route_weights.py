"""An HTTPRoute's weights for a live canary: the other backends keep their proportions, and
the route is put back as it was found.

A rule may split between several backends already (the stable Service and another, 50/50).
The canary's share is taken from all of them alike, each keeping its part of the rest, so a
50/50 split with a 10 % canary is 45/45/10, never 90/50/10. The weights each rule had when
kvpilot first changed it are remembered (`Found`), in the route itself (an annotation, so
that the pod that cleans up another's canary, evicted mid-trial, knows them too), and the
pull-back writes them back, a weight left unset unset again, in the one patch that sends the
canary's traffic home; the annotation goes with the canary's backendRefs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ANNOTATION = "kvpilot.dev/weights-before-canary"
_ANNOTATION_PATH = "/metadata/annotations/" + ANNOTATION.replace("~", "~0").replace("/", "~1")
Ref = Mapping[str, Any]
RefKey = tuple[str, str, str, str, str]


def ref_key(ref: Ref) -> RefKey:
    """A backendRef's identity within its rule (indices move when others are added)."""
    return (
        str(ref.get("group", "")),
        str(ref.get("kind", "Service")),
        str(ref.get("namespace", "")),
        str(ref.get("name")),
        str(ref.get("port", "")),
    )


def is_service(ref: Ref, name: str) -> bool:
    return (
        ref.get("name") == name
        and ref.get("group", "") == ""
        and ref.get("kind", "Service") == "Service"
    )


@dataclass(frozen=True, slots=True)
class Found:
    """Each split rule's backendRefs' weights as found: rule index -> ((key, weight or
    None for unset), ...), the canary's own refs left out."""

    rules: tuple[tuple[int, tuple[tuple[RefKey, int | None], ...]], ...]

    def weights(self, rule: int) -> dict[RefKey, int | None] | None:
        return next((dict(refs) for r, refs in self.rules if r == rule), None)


def from_annotation(route: Ref) -> Found | None:
    """The weights as found, kept on the route by whichever pod changed it first."""
    text = ((route.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
    if not text:
        return None
    try:
        rules = json.loads(text)
        return Found(
            tuple(
                (int(r), tuple((tuple(str(k) for k in key), w) for key, w in refs))  # type: ignore[misc]
                for r, refs in rules
            )
        )
    except (ValueError, TypeError):
        return None  # not ours to read: the stable takes the canary's weight instead


def annotate_ops(route: Ref, was: Found) -> list[dict[str, Any]]:
    """Ops that keep `was` on the route, unless it holds a record already."""
    annotations = (route.get("metadata") or {}).get("annotations")
    if annotations and ANNOTATION in annotations:
        return []
    text = json.dumps([[r, [[list(k), w] for k, w in refs]] for r, refs in was.rules])
    if annotations is None:
        return [{"op": "add", "path": "/metadata/annotations", "value": {ANNOTATION: text}}]
    return [{"op": "add", "path": _ANNOTATION_PATH, "value": text}]


def unannotate_ops(route: Ref) -> list[dict[str, Any]]:
    annotations = (route.get("metadata") or {}).get("annotations") or {}
    return [{"op": "remove", "path": _ANNOTATION_PATH}] if ANNOTATION in annotations else []


def split_rules(route: Ref, stable: str) -> list[int]:
    """The rules that route to the stable Service."""
    rules = (route.get("spec") or {}).get("rules") or ()
    return [
        i
        for i, rule in enumerate(rules)
        if any(is_service(ref, stable) for ref in rule.get("backendRefs") or ())
    ]


def found(route: Ref, stable: str, canary: str) -> Found:
    """The route's weights now, as the ones to restore."""
    rules = route["spec"]["rules"]
    return Found(
        tuple(
            (
                r,
                tuple(
                    (ref_key(ref), ref.get("weight"))
                    for ref in rules[r]["backendRefs"]
                    if not is_service(ref, canary)
                ),
            )
            for r in split_rules(route, stable)
        )
    )


def _set(path: str, ref: Ref, weight: int | None) -> list[dict[str, Any]]:
    """JSON-patch ops that set (None: unset) a backendRef's weight, after testing its name."""
    test = {"op": "test", "path": f"{path}/name", "value": ref["name"]}
    if weight is None:
        return [test, {"op": "remove", "path": f"{path}/weight"}] if "weight" in ref else []
    if ref.get("weight") == weight:
        return []
    return [
        test,
        {"op": "replace" if "weight" in ref else "add", "path": f"{path}/weight", "value": weight},
    ]


def share_ops(
    route: Ref, was: Found, canary: str, total: int, canary_w: int, port: int
) -> list[dict[str, Any]]:
    """Ops that give the canary `canary_w` of `total` in each split rule, the other
    backends sharing the rest in the proportions they were found in."""
    ops: list[dict[str, Any]] = []
    for r, _ in was.rules:
        weights = was.weights(r) or {}
        whole = sum(1 if w is None else w for w in weights.values()) or 1
        refs = route["spec"]["rules"][r]["backendRefs"]
        for j, ref in enumerate(refs):
            path = f"/spec/rules/{r}/backendRefs/{j}"
            if is_service(ref, canary):
                ops += _set(path, ref, canary_w)
                continue
            before = weights.get(ref_key(ref), ref.get("weight"))
            part = 1 if before is None else before
            ops += _set(path, ref, max(1, round(part * (total - canary_w) / whole)) if part else 0)
            port = ref.get("port", port)
        if canary_w and not any(is_service(ref, canary) for ref in refs):
            new = {"name": canary, "port": port, "weight": canary_w}
            ops.append({"op": "add", "path": f"/spec/rules/{r}/backendRefs/-", "value": new})
    return ops


def restore_ops(route: Ref, was: Found | None, stable: str, canary: str) -> list[dict[str, Any]]:
    """Ops that send the canary nothing and put the other weights back as found; without a
    record of them (another pod's canary) the stable takes the canary's weight."""
    ops: list[dict[str, Any]] = []
    for r in split_rules(route, stable):
        refs = route["spec"]["rules"][r]["backendRefs"]
        weights = None if was is None else was.weights(r)
        taken = sum(int(ref.get("weight", 1)) for ref in refs if is_service(ref, canary))
        for j, ref in enumerate(refs):
            path = f"/spec/rules/{r}/backendRefs/{j}"
            if is_service(ref, canary):
                ops += _set(path, ref, 0)
            elif weights is not None and ref_key(ref) in weights:
                ops += _set(path, ref, weights[ref_key(ref)])
            elif weights is None and is_service(ref, stable) and taken:
                ops += _set(path, ref, max(1, int(ref.get("weight", 1)) + taken))
    return ops
