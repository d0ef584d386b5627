"""The sidecar's own Deployment, found from its pod's ownerReferences: pod -> ReplicaSet ->
Deployment, as the Deployment controller sets them. Blocking: call in a thread."""

from __future__ import annotations

from typing import Any

from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.api import call, client_module


class NoOwningDeployment(RuntimeFailure):
    """The pod belongs to no Deployment (a bare pod, a StatefulSet's, a Job's)."""


def _controller(meta: Any, kind: str) -> str | None:
    for ref in meta.owner_references or ():
        if ref.kind == kind and ref.controller:
            return str(ref.name)
    return None


def owning_deployment(api_client: Any, namespace: str, pod: str) -> str:
    """The name of the Deployment whose ReplicaSet controls `pod`."""
    k8s = client_module()
    found = call(
        k8s.CoreV1Api(api_client).read_namespaced_pod,
        pod,
        namespace,
        verb="get",
        resource="pods",
        what=f"Pod {namespace}/{pod}",
    )
    replica_set = _controller(found.metadata, "ReplicaSet")
    if replica_set is None:
        raise NoOwningDeployment(
            f"Pod {namespace}/{pod} is controlled by no ReplicaSet: set kubernetes.deployment"
        )
    owner = call(
        k8s.AppsV1Api(api_client).read_namespaced_replica_set,
        replica_set,
        namespace,
        verb="get",
        resource="replicasets.apps",
        what=f"ReplicaSet {namespace}/{replica_set}",
    )
    deployment = _controller(owner.metadata, "Deployment")
    if deployment is None:
        raise NoOwningDeployment(
            f"ReplicaSet {namespace}/{replica_set} is controlled by no Deployment: "
            "set kubernetes.deployment"
        )
    return deployment


def replica_names(api_client: Any, namespace: str, deployment: str) -> list[str]:
    """The pods its Deployment's selector picks now (matchLabels: what a Deployment's
    selector holds in practice), the replicas alive to keep their own guards."""
    k8s = client_module()
    found = call(
        k8s.AppsV1Api(api_client).read_namespaced_deployment,
        deployment,
        namespace,
        verb="get",
        resource="deployments.apps",
        what=f"Deployment {namespace}/{deployment}",
    )
    wanted = (found.spec.selector.match_labels or {}) if found.spec.selector else {}
    listed = call(
        k8s.CoreV1Api(api_client).list_namespaced_pod,
        namespace,
        label_selector=",".join(f"{k}={v}" for k, v in sorted(wanted.items())),
        verb="list",
        resource="pods",
        what=f"the pods of Deployment {namespace}/{deployment}",
    )
    return [str(pod.metadata.name) for pod in listed.items]
