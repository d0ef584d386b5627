"""Kubernetes objects as the API writes them: the canary from the stable Deployment, patches.

Deployments are handled in their wire form (the camelCase dicts that
`ApiClient.sanitize_for_serialization` returns): the canary is a copy of the stable pod
template, and a copy of the wire form keeps every field the client's models might not know.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.collectors.secrets import mask_argv
from kvpilot.collectors.vllm_argv import launch_split

ROLE_LABEL = "kvpilot.dev/role"  # as in deploy/base/deployment.yaml
CANARY_OF_ANNOTATION = "kvpilot.dev/canary-of"
CANARY_OF_LABEL = "kvpilot.dev/canary-of"  # on the canary's pods: which stable they test
LABEL_VALUE_MAX = 63
CANARY_SUFFIX = "-kvpilot-canary"
RESTARTED_AT_ANNOTATION = "kubectl.kubernetes.io/restartedAt"
# Annotations that would tie the canary to the stable's history or to a GitOps application
# (Argo CD would prune a canary carrying its tracking id or instance label).
_DROPPED_ANNOTATIONS = (
    "deployment.kubernetes.io/revision",
    "kubectl.kubernetes.io/last-applied-configuration",
    "argocd.argoproj.io/tracking-id",
)
_GITOPS_LABELS = (
    "argocd.argoproj.io/instance",
    "kustomize.toolkit.fluxcd.io/name",
    "helm.toolkit.fluxcd.io/name",
)
_GITOPS_MANAGERS = ("argo", "flux", "kustomize-controller", "helm-controller")
Obj = dict[str, Any]


def canary_name(stable: str) -> str:
    return f"{stable}{CANARY_SUFFIX}"


def find_container(pod_spec: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    containers: Iterable[Mapping[str, Any]] = pod_spec.get("containers") or ()
    for container in containers:
        if container.get("name") == name:
            return container
    return None


def container_argv(deployment: Mapping[str, Any], container: str) -> tuple[str, ...] | None:
    """The container's command and args joined, or None when there is no such container."""
    found = find_container(deployment["spec"]["template"]["spec"], container)
    if found is None:
        return None
    return (*(found.get("command") or ()), *(found.get("args") or ()))


@dataclass(frozen=True, slots=True)
class ContainerCommand:
    """What a container runs: `command` None keeps the container's (or the image's) own."""

    command: tuple[str, ...] | None
    args: tuple[str, ...]


def split_argv(argv: Sequence[str], current_command: Sequence[str] | None) -> ContainerCommand:
    """Map a runtime argv onto a container's command and args.

    Flags alone (`--model ...`) replace the args; an argv that starts with the container's
    command keeps it; any other vLLM launch form sets both, so the pod runs exactly `argv`.
    """
    argv = list(argv)
    if not argv:
        raise ValueError("empty argv")
    current = list(current_command or ())
    if current and argv[: len(current)] == current:
        return ContainerCommand(None, tuple(argv[len(current) :]))
    split = launch_split(argv)
    if split is not None:
        cut = len(argv) - len(split[1])
        return ContainerCommand(tuple(argv[:cut]), tuple(argv[cut:]))
    if argv[0].startswith("-"):
        return ContainerCommand(None, tuple(argv))
    raise ValueError(f"not a vLLM command line nor flags: {mask_argv(argv)[:3]!r}")


def _with_command(container: Obj, command: ContainerCommand) -> None:
    if command.command is not None:
        container["command"] = list(command.command)
    container["args"] = list(command.args)


def gitops_owner(deployment: Mapping[str, Any]) -> str | None:
    """The GitOps tool that owns this Deployment by its labels, or None."""
    meta = deployment.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    for key in _GITOPS_LABELS:
        if key in labels:
            return f"label {key}={labels[key]}"
    if "argocd.argoproj.io/tracking-id" in annotations:
        return "annotation argocd.argoproj.io/tracking-id"
    manager = str(labels.get("app.kubernetes.io/managed-by", ""))
    if any(tool in manager.lower() for tool in _GITOPS_MANAGERS):
        return f"label app.kubernetes.io/managed-by={manager}"
    return None


HELM_RELEASE_ANNOTATION = "meta.helm.sh/release-name"


def helm_owner(deployment: Mapping[str, Any]) -> str | None:
    """How Helm owns this Deployment (its next `helm upgrade` would undo a patch), or None:
    `app.kubernetes.io/managed-by: Helm` in any letter case, or Helm's release annotation."""
    meta = deployment.get("metadata") or {}
    manager = str((meta.get("labels") or {}).get("app.kubernetes.io/managed-by", ""))
    if manager.strip().lower() == "helm":
        return f"label app.kubernetes.io/managed-by={manager}"
    release = (meta.get("annotations") or {}).get(HELM_RELEASE_ANNOTATION)
    if release:
        return f"annotation {HELM_RELEASE_ANNOTATION}={release}"
    return None


def canary_pod_selector(stable: str) -> dict[str, str]:
    """The labels of a canary's pods and its ReplicaSet's selector: the role and the stable
    Deployment's name (a label value: cut to 63 characters, a digest keeping it unique)."""
    value = stable
    if len(value) > LABEL_VALUE_MAX:
        digest = hashlib.sha256(stable.encode()).hexdigest()[:10]
        value = f"{stable[: LABEL_VALUE_MAX - 11].rstrip('.-_')}-{digest}"
    return {ROLE_LABEL: "canary", CANARY_OF_LABEL: value}


def _canary_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    out = {k: v for k, v in (labels or {}).items() if k not in _GITOPS_LABELS}
    if "managed-by" in str(out.get("app.kubernetes.io/managed-by", "")).lower():
        out.pop("app.kubernetes.io/managed-by")
    out[ROLE_LABEL] = "canary"
    return out


def build_canary(
    stable: Mapping[str, Any],
    *,
    container: str,
    command: ContainerCommand,
    sidecar_container: str | None,
    serve_labels: Mapping[str, str] | None = None,
) -> Obj:
    """The canary Deployment: the stable pod template with the candidate's command.

    One replica, role label `canary` on the Deployment; its pods carry kvpilot's labels only
    (`canary_pod_selector`, also its selector), none of the stable's, so that nothing that
    selects the stable's pods (its Deployment, a Service, a router) picks them; owned by
    the stable Deployment so that deleting the stable collects it. The owner reference
    leaves `blockOwnerDeletion` unset: setting it needs `update` on `deployments/finalizers`,
    which the Role does not grant.

    `serve_labels` is for the service-share way of splitting traffic: the selector of the
    Service whose traffic the canary shares. Its pods then carry those labels, so the
    Service sends them their share as soon as they are ready. The role label stays
    `canary` (a pod the stable Deployment's selector picked would be taken for the stable),
    so such a Service must not select on the role.
    """
    if serve_labels and ROLE_LABEL in serve_labels:
        raise ValueError(
            f"the Service selects on {ROLE_LABEL}={serve_labels[ROLE_LABEL]}: a canary cannot "
            "share its traffic; select the pods of both roles (without the role label)"
        )
    meta = stable["metadata"]
    spec = stable["spec"]
    template = copy.deepcopy(spec["template"])
    pod_spec = template["spec"]
    target = next((c for c in pod_spec.get("containers") or () if c.get("name") == container), None)
    if target is None:
        raise ValueError(f"Deployment {meta['name']!r} has no container {container!r}")
    _with_command(target, command)
    # The kubelet then copies the log tail into the termination message that `get pods`
    # shows, so a start-up failure reports vLLM's own reason without the pods/log verb.
    target["terminationMessagePolicy"] = "FallbackToLogsOnError"
    if sidecar_container is not None:
        pod_spec["containers"] = [
            c for c in pod_spec["containers"] if c.get("name") != sidecar_container
        ]
        # The sidecar's volumes go with it: its state claim (ReadWriteOnce) would keep the
        # canary pod from being scheduled anywhere but beside the stable pod.
        _drop_unmounted_volumes(pod_spec)
    template_meta = template.setdefault("metadata", {})
    # The canary's pods carry kvpilot's labels only: a router that picks pods by the stable's
    # labels (production-stack's --k8s-label-selector, an InferencePool's spec.selector, a
    # Service) would otherwise send a replayed candidate real traffic. Live traffic asks
    # for the labels it needs (`serve_labels`).
    pod_selector = canary_pod_selector(meta["name"])
    template_meta["labels"] = {**pod_selector, **(serve_labels or {})}
    annotations = dict(template_meta.get("annotations") or {})
    annotations.pop(RESTARTED_AT_ANNOTATION, None)
    if annotations:
        template_meta["annotations"] = annotations
    else:
        template_meta.pop("annotations", None)
    selector = {"matchLabels": pod_selector}
    out_annotations = {
        k: v for k, v in (meta.get("annotations") or {}).items() if k not in _DROPPED_ANNOTATIONS
    }
    out_annotations[CANARY_OF_ANNOTATION] = meta["name"]
    new_spec: Obj = {"replicas": 1, "selector": selector, "template": template}
    for key in ("minReadySeconds", "progressDeadlineSeconds", "strategy"):
        if key in spec:
            new_spec[key] = copy.deepcopy(spec[key])
    new_meta: Obj = {
        "name": canary_name(meta["name"]),
        "namespace": meta.get("namespace"),
        "labels": _canary_labels(meta.get("labels")),
        "annotations": out_annotations,
        "ownerReferences": [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": meta["name"],
                "uid": meta["uid"],
            }
        ],
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": new_meta, "spec": new_spec}


def is_canary_of(obj: Mapping[str, Any], deployment: str) -> bool:
    """Whether `obj` is a canary `build_canary` made of `deployment`: its role label and its
    canary-of annotation (a Deployment of that name made by someone else is left alone)."""
    meta = obj.get("metadata") or {}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    return (
        labels.get(ROLE_LABEL) == "canary" and annotations.get(CANARY_OF_ANNOTATION) == deployment
    )


def args_patch(container: str, command: ContainerCommand, resource_version: str | None) -> Obj:
    """A strategic-merge patch that sets one container's args (and command if given).

    Containers merge by name, so the other containers and fields stay as they are; with
    `resource_version` the server answers 409 if the Deployment changed since it was read.
    """
    entry: Obj = {"name": container}
    _with_command(entry, command)
    patch: Obj = {"spec": {"template": {"spec": {"containers": [entry]}}}}
    if resource_version is not None:
        patch["metadata"] = {"resourceVersion": resource_version}
    return patch


def restart_patch(wall_s: float) -> Obj:
    """What `kubectl rollout restart` patches: a pod template annotation with the time."""
    restarted_at = datetime.fromtimestamp(wall_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    annotations = {RESTARTED_AT_ANNOTATION: restarted_at}
    return {"spec": {"template": {"metadata": {"annotations": annotations}}}}


@dataclass(frozen=True, slots=True)
class Rollout:
    """Whether a Deployment's rollout has finished, as `kubectl rollout status` decides."""

    complete: bool
    failed: bool
    reason: str


def rollout_state(deployment: Mapping[str, Any]) -> Rollout:
    meta, spec = deployment["metadata"], deployment["spec"]
    status = deployment.get("status") or {}
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Progressing" and condition.get("reason") == (
            "ProgressDeadlineExceeded"
        ):
            return Rollout(False, True, f"progress deadline exceeded: {condition.get('message')}")
    generation = int(meta.get("generation") or 0)
    observed = int(status.get("observedGeneration") or 0)
    if observed < generation:
        return Rollout(False, False, f"observed generation {observed} < {generation}")
    wanted = int(spec.get("replicas", 1))
    updated = int(status.get("updatedReplicas") or 0)
    total = int(status.get("replicas") or 0)
    available = int(status.get("availableReplicas") or 0)
    if updated < wanted:
        return Rollout(False, False, f"{updated} of {wanted} replicas updated")
    if total > updated:
        return Rollout(False, False, f"{total - updated} old replicas pending termination")
    if available < updated:
        return Rollout(False, False, f"{available} of {updated} updated replicas available")
    return Rollout(True, False, f"{updated} replicas updated and available")


_OPERATORS = {"In": "in", "NotIn": "notin"}


def selector_string(deployment: Mapping[str, Any]) -> str:
    """The Deployment's selector, matchLabels and matchExpressions, as a label selector;
    RuntimeFailure for one that would select every pod (empty) or that the API cannot say."""
    selector = deployment["spec"]["selector"]
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or ():
        key, operator = expression["key"], expression["operator"]
        values = ",".join(sorted(expression.get("values") or ()))
        if operator in _OPERATORS:
            parts.append(f"{key} {_OPERATORS[operator]} ({values})")
        elif operator in ("Exists", "DoesNotExist"):
            parts.append(key if operator == "Exists" else f"!{key}")
        else:
            raise RuntimeFailure(f"selector operator {operator!r} is not one of the API's")
    if not parts:
        raise RuntimeFailure("the Deployment's selector is empty: it would select every pod")
    return ",".join(parts)


def pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = status.get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def container_failure(pod: Mapping[str, Any], container: str) -> tuple[str, str | None] | None:
    """(why, log tail) when the container is crash-looping or cannot start, else None."""
    for status in (pod.get("status") or {}).get("containerStatuses") or ():
        if status.get("name") != container:
            continue
        state = status.get("state") or {}
        last = (status.get("lastState") or {}).get("terminated") or {}
        waiting = state.get("waiting") or {}
        terminated = state.get("terminated") or {}
        if waiting.get("reason") in _FATAL_WAITING:
            detail = waiting.get("message") or waiting["reason"]
            return f"{waiting['reason']}: {detail}", last.get("message")
        if terminated and terminated.get("exitCode") not in (None, 0):
            why = f"exited with code {terminated['exitCode']} ({terminated.get('reason')})"
            return why, terminated.get("message")
    return None


# Waiting reasons that are the cluster's, not the candidate's: its image or its configuration
# cannot be had. A trial that meets one fails; it says nothing of the candidate's flags.
INFRASTRUCTURE_WAITING = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError"}
)


def failed_start(pods: list[dict[str, Any]], container: str) -> tuple[str, str | None, bool] | None:
    """(why, log tail, the cluster's fault?) for the first pod whose container cannot start."""
    for pod in pods:
        failure = container_failure(pod, container)
        if failure is not None:
            cluster = failure[0].split(":")[0] in INFRASTRUCTURE_WAITING
            return f"pod {pod['metadata']['name']}: {failure[0]}", failure[1], cluster
    return None


def unschedulable(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's message when the pod cannot be placed on any node, else None."""
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return str(condition.get("message") or "Unschedulable")
    return None


_FATAL_WAITING = frozenset(
    {
        "CrashLoopBackOff",
        "ErrImagePull",
        "ImagePullBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "InvalidImageName",
        "RunContainerError",
    }
)


def _drop_unmounted_volumes(pod_spec: Obj) -> None:
    containers = [*(pod_spec.get("containers") or ()), *(pod_spec.get("initContainers") or ())]
    mounted = {m.get("name") for c in containers for m in c.get("volumeMounts") or ()}
    volumes = [v for v in pod_spec.get("volumes") or () if v.get("name") in mounted]
    if volumes:
        pod_spec["volumes"] = volumes
    else:
        pod_spec.pop("volumes", None)
