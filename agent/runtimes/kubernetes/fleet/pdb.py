"""The PodDisruptionBudget's word on a restart by signal, which the PDB itself never sees.

An eviction asks the API server, which honours the PDB; a signal to vLLM's process goes
around it, so before one kvpilot reads the PDBs that select the pod and goes only when each
allows a disruption (`status.disruptionsAllowed` of at least 1). Blocking: call in a thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.agent.runtimes.kubernetes.api import NotFound, call, client_module

RESOURCE = "poddisruptionbudgets.policy"


@dataclass(frozen=True, slots=True)
class DisruptionVerdict:
    allowed: bool
    reason: str


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) over `labels`; an empty one selects
    every pod, as the PDB controller reads it for policy/v1."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or ():
        key, op = expression.get("key"), expression.get("operator")
        values = set(expression.get("values") or ())
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def disruption_verdict(
    api_client: Any, namespace: str, pod_labels: Mapping[str, str]
) -> DisruptionVerdict:
    """Whether every PDB that selects the pod allows one more disruption now."""
    try:
        listed = call(
            client_module().PolicyV1Api(api_client).list_namespaced_pod_disruption_budget,
            namespace,
            verb="list",
            resource=RESOURCE,
            what=f"PodDisruptionBudgets in {namespace}",
        )
    except NotFound:  # an API server without policy/v1: nothing there can forbid it
        return DisruptionVerdict(True, "this API server serves no PodDisruptionBudgets")
    chosen = [
        p
        for p in (api_client.sanitize_for_serialization(item) for item in listed.items)
        if selects((p.get("spec") or {}).get("selector"), pod_labels)
    ]
    if not chosen:
        return DisruptionVerdict(True, "no PodDisruptionBudget selects this pod")
    for pdb in chosen:
        allowed = int((pdb.get("status") or {}).get("disruptionsAllowed") or 0)
        if allowed < 1:
            name = pdb["metadata"]["name"]
            return DisruptionVerdict(
                False, f"PodDisruptionBudget {name} allows no disruption now (disruptionsAllowed 0)"
            )
    names = ", ".join(p["metadata"]["name"] for p in chosen)
    return DisruptionVerdict(True, f"PodDisruptionBudget {names} allows a disruption")


def pod_disruption_verdict(api_client: Any, namespace: str, pod: str) -> DisruptionVerdict:
    """`disruption_verdict` for the pod by name: its labels read now (a rollout may have
    changed them since start-up)."""
    found = call(
        client_module().CoreV1Api(api_client).read_namespaced_pod,
        pod,
        namespace,
        verb="get",
        resource="pods",
        what=f"Pod {namespace}/{pod}",
    )
    return disruption_verdict(api_client, namespace, found.metadata.labels or {})
