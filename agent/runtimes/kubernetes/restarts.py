"""A canary's container restarts as the kubelet counts them: the `restartCount` of the vLLM
container in each of the canary Deployment's pods. A crash that vLLM's own counters hide
(the container back up between two scrapes of /metrics, its counters past where they were)
still shows here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpilot.agent.runtimes.kubernetes import objects
from kvpilot.agent.runtimes.kubernetes.api import NotFound, call, client_module
from kvpilot.agent.runtimes.kubernetes.values import KubernetesTarget


def restart_count(pod: Mapping[str, Any], container: str) -> int | None:
    """The kubelet's restart count of `container` in `pod` (None: no status for it yet)."""
    for status in (pod.get("status") or {}).get("containerStatuses") or ():
        if status.get("name") == container:
            count = status.get("restartCount")
            return count if isinstance(count, int) and count >= 0 else None
    return None


class CanaryRestarts:
    """Reads the canary's restarts, summed over its pods; None when there is no canary or
    no pod reports its container yet. Blocking: call it in a thread."""

    def __init__(self, api_client: Any, target: KubernetesTarget) -> None:
        self._api = api_client
        self._target = target

    def __call__(self) -> int | None:
        target, k8s = self._target, client_module()
        what = f"Deployment {target.namespace}/{target.canary_name}"
        try:
            canary = call(
                k8s.AppsV1Api(self._api).read_namespaced_deployment,
                target.canary_name,
                target.namespace,
                verb="get",
                resource="deployments.apps",
                what=what,
            )
        except NotFound:
            return None
        selector = objects.selector_string(self._api.sanitize_for_serialization(canary))
        pods = call(
            k8s.CoreV1Api(self._api).list_namespaced_pod,
            target.namespace,
            label_selector=selector,
            verb="list",
            resource="pods",
            what=f"pods {selector!r} in {target.namespace}",
        )
        counts = [
            restart_count(self._api.sanitize_for_serialization(pod), target.container)
            for pod in pods.items
        ]
        known = [c for c in counts if c is not None]
        return sum(known) if known else None
