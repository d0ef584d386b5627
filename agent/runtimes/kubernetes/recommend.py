"""Recommend-only promotion: the patch written to a file, announced as an Event on the
Deployment.

A GitOps controller owns the Deployment's spec, so kvpilot changes nothing on it (no
annotation either: the controller would revert it, and writing it needs `patch`). The patch
goes to the state directory, secrets masked, and a core/v1 Event on the Deployment
(`kubectl describe deployment` and `kubectl get events` show it) names the file and the
`kubectl patch` command. The Event needs `create` on `events`; without it the file is still
written and the recommendation says what is missing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from datetime import UTC, datetime
from typing import Any

from kvpilot.agent.runtimes.kubernetes.api import KubernetesApiError, call
from kvpilot.agent.runtimes.kubernetes.objects import gitops_owner, helm_owner
from kvpilot.agent.runtimes.kubernetes.values import KubernetesTarget, Recommendation
from kvpilot.collectors.secrets import MASK, mask, mask_text

log = logging.getLogger(__name__)

EVENTS = "events"
EVENT_REASON = "KvpilotRecommendation"
EVENT_ACTION = "RecommendPromotion"
COMPONENT = "kvpilot"
MAX_MESSAGE_CHARS = 1024  # what events.k8s.io allows a note; core/v1 clients cut there too


def recommend(
    core: Any,
    target: KubernetesTarget,
    stable: dict[str, Any],
    patch: dict[str, Any],
    why: str,
    *,
    wall_s: float,
    identity: str,
) -> Recommendation:
    """Write the patch, then announce it with an Event; the recommendation says both."""
    written = write_patch(target, stable, patch, why, wall_s)
    body = event_body(written, stable, wall_s=wall_s, identity=identity)
    return dataclasses.replace(written, event=announce(core, body))


def write_patch(
    target: KubernetesTarget,
    stable: dict[str, Any],
    patch: dict[str, Any],
    why: str,
    wall_s: float,
) -> Recommendation:
    """The patch as a JSON file in the state directory (where there is one), masked."""
    meta = stable["metadata"]
    masked = mask(patch)  # the file may end in a repository; the applied patch keeps them
    if masked != patch:
        why += f"; secret values are masked as {MASK} in the patch: put them back first"
    text = json.dumps(masked, indent=2, sort_keys=True)
    path = None
    if target.state_dir is not None:
        folder = target.state_dir / "k8s-recommendations"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{meta['name']}-{_stamp(wall_s)}.json"
        path.write_text(text + "\n")
    where = str(path) if path else "PATCH.json"
    kubectl = (
        f"kubectl -n {target.namespace} patch deployment {meta['name']} "
        f"--type strategic --patch-file {where}"
    )
    return Recommendation(meta["name"], target.namespace, text, path, why, kubectl, wall_s=wall_s)


def event_body(
    recommendation: Recommendation, stable: dict[str, Any], *, wall_s: float, identity: str
) -> dict[str, Any]:
    """The core/v1 Event on the Deployment that announces `recommendation`."""
    meta = stable["metadata"]
    where = recommendation.path or "no file (no state directory configured)"
    message = mask_text(
        f"kvpilot recommends new flags for this Deployment ({recommendation.reason}). "
        f"The patch is in {where} in kvpilot's state directory; apply it with: "
        f"{recommendation.kubectl}"
    )
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 1] + "…"
    stamp = _iso(wall_s)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            # As the API server's recorders name them: the object's name and a unique suffix.
            "name": f"{meta['name']}.{int(wall_s * 1e9):x}",
            "namespace": recommendation.namespace,
        },
        "involvedObject": {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": meta["name"],
            "namespace": recommendation.namespace,
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": "Normal",
        "reason": EVENT_REASON,
        "action": EVENT_ACTION,
        "message": message,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": identity,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def announce(core: Any, body: dict[str, Any]) -> str:
    """Create the Event; what became of it, in words (a refusal names what is missing)."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    try:
        call(
            core.create_namespaced_event,
            namespace,
            body,
            verb="create",
            resource=EVENTS,
            what=f"Event {namespace}/{name}",
        )
    except KubernetesApiError as exc:
        log.warning("recommend-only: the patch is written, the Event is not: %s", exc)
        return f"no Event: {exc}"
    return f"Event {namespace}/{name} (reason {EVENT_REASON})"


def _iso(wall_s: float) -> str:
    return datetime.fromtimestamp(wall_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stamp(wall_s: float) -> str:
    return datetime.fromtimestamp(wall_s, UTC).strftime("%Y%m%dT%H%M%S%fZ")


def promote_mode(target: KubernetesTarget, stable: dict[str, Any]) -> tuple[bool, str]:
    """(apply?, why): recommend-only when configured, or when GitOps or Helm owns the
    Deployment (the next sync or `helm upgrade` would undo a patch)."""
    if target.promote == "recommend":
        return False, "recommend-only is configured"
    owner = gitops_owner(stable)
    if target.promote == "auto" and owner is not None:
        return False, f"the Deployment belongs to GitOps ({owner})"
    helm = helm_owner(stable)
    if target.promote == "auto" and helm is not None:
        return False, f"the Deployment belongs to a Helm release ({helm}): change its values"
    owner = owner or helm
    return True, "apply" if owner is None else f"apply is configured despite {owner}"
