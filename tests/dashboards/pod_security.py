"""Pod Security "restricted", checked on a rendered pod spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The restricted profile's allowed volume types (hostPath has its own, baseline control).
VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
SECCOMP_TYPES = frozenset({"RuntimeDefault", "Localhost"})
ADDABLE_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# The securityContext fields the controls below judge, and those no control restricts.
# Any other field (seLinuxOptions, sysctls, procMount, windowsOptions, appArmorProfile)
# has a control this checker does not implement, so it is reported, never passed.
POD_CONTEXT_FIELDS = frozenset(
    {
        "runAsNonRoot",
        "runAsUser",
        "runAsGroup",
        "fsGroup",
        "fsGroupChangePolicy",
        "supplementalGroups",
        "seccompProfile",
    }
)
CONTAINER_CONTEXT_FIELDS = frozenset(
    {
        "allowPrivilegeEscalation",
        "capabilities",
        "privileged",
        "readOnlyRootFilesystem",
        "runAsNonRoot",
        "runAsUser",
        "runAsGroup",
        "seccompProfile",
    }
)
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


@dataclass(frozen=True, slots=True)
class Violation:
    control: str  # the profile's name for it, e.g. "Privilege Escalation"
    where: str  # "pod" or "container NAME"
    detail: str


def restricted_violations(pod: dict[str, Any]) -> list[Violation]:
    """The restricted profile's controls for the fields these manifests use, after
    kubernetes.io/docs/concepts/security/pod-security-standards: host namespaces,
    privileged containers, capabilities, HostPath volumes, host ports, volume types,
    privilege escalation, running as non-root (and as a non-root user) and seccomp, for
    every init, app and ephemeral container. A securityContext field outside those is
    reported as unchecked rather than passed."""
    out: list[Violation] = []
    context = pod.get("securityContext") or {}
    for name in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(name):
            out.append(Violation("Host Namespaces", "pod", f"{name} is true"))
    out += [
        Violation("unchecked field", "pod", f"securityContext.{name}")
        for name in sorted(set(context) - POD_CONTEXT_FIELDS)
    ]
    if context.get("runAsUser") == 0:
        out.append(Violation("Running as Non-root user", "pod", "runAsUser is 0"))
    pod_seccomp = (context.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_TYPES:
        out.append(Violation("Seccomp", "pod", f"seccompProfile.type is {pod_seccomp}"))
    for volume in pod.get("volumes") or ():
        (kind,) = set(volume) - {"name"}
        if kind == "hostPath":
            out.append(Violation("HostPath Volumes", "pod", f"volume {volume['name']}"))
        elif kind not in VOLUME_TYPES:
            out.append(Violation("Volume Types", "pod", f"volume {volume['name']} is {kind}"))
    for field in CONTAINER_LISTS:
        for container in pod.get(field) or ():
            out += _container_violations(container, context)
    return out


def _container_violations(
    container: dict[str, Any], pod_context: dict[str, Any]
) -> list[Violation]:
    where = f"container {container['name']}"
    context = container.get("securityContext") or {}
    out = [
        Violation("unchecked field", where, f"securityContext.{name}")
        for name in sorted(set(context) - CONTAINER_CONTEXT_FIELDS)
    ]
    if context.get("privileged"):
        out.append(Violation("Privileged Containers", where, "privileged is true"))
    for port in container.get("ports") or ():
        if port.get("hostPort"):
            out.append(Violation("Host Ports", where, f"hostPort {port['hostPort']}"))
    if context.get("allowPrivilegeEscalation") is not False:
        out.append(Violation("Privilege Escalation", where, "allowPrivilegeEscalation not false"))
    capabilities = context.get("capabilities") or {}
    if "ALL" not in (capabilities.get("drop") or ()):
        out.append(Violation("Capabilities", where, "capabilities.drop lacks ALL"))
    if added := set(capabilities.get("add") or ()) - ADDABLE_CAPABILITIES:
        out.append(Violation("Capabilities", where, f"capabilities.add {sorted(added)}"))
    non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))
    if non_root is not True:
        out.append(Violation("Running as Non-root", where, f"runAsNonRoot is {non_root}"))
    if context.get("runAsUser") == 0:
        out.append(Violation("Running as Non-root user", where, "runAsUser is 0"))
    seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
    if seccomp not in SECCOMP_TYPES:
        out.append(Violation("Seccomp", where, f"seccompProfile.type is {seccomp}"))
    return out
