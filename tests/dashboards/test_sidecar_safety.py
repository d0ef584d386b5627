"""A sidecar that cannot hurt serving, checked on the manifests as kustomize renders them.

What a pod played on this machine cannot show: that kvpilot's state never gates the pod's
readiness, that the service-account token reaches kvpilot's container alone, Pod Security
"restricted", that the control API is not on a port the Service exposes, and that kvpilot's
port is one no common exporter takes. Every layer of deploy/ is checked, and the Component
deploy/components/sidecar too, put on a minimal Deployment of the user's.
"""

from __future__ import annotations

import copy
import ipaddress
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from kustomize_builds import DEPLOY, LAYERS, build, kubectl, missing_input, of_kind
from pod_security import restricted_violations

from kvpilot.agent.config import AgentConfig, load_config
from kvpilot.agent.config.agent import ListenConfig

Doc = dict[str, Any]
COMPONENT = DEPLOY / "components" / "sidecar"
SOURCES = (*LAYERS, "component")
SIDECAR, VLLM = "kvpilot", "vllm"
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
DCGM_EXPORTER_PORT = 9400
EXPORTER_REGISTRY = range(9100, 10000)  # Prometheus' default port allocations for exporters

# The Deployment a user already runs, as small as a Deployment is: the Component finds it by
# its annotation, whatever its name.
USER_PROBE = {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 5}
USER_DEPLOYMENT: Doc = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "serving-engine", "annotations": {"kvpilot.dev/inject": "true"}},
    "spec": {
        "selector": {"matchLabels": {"app": "serving-engine"}},
        "template": {
            "metadata": {"labels": {"app": "serving-engine"}},
            "spec": {
                "containers": [
                    {
                        "name": VLLM,
                        "image": "vllm/vllm-openai:v0.32.0",
                        "args": ["--model=Qwen/Qwen2.5-1.5B-Instruct", "--port=8000"],
                        "ports": [{"name": "http", "containerPort": 8000}],
                        "readinessProbe": USER_PROBE,
                        "livenessProbe": {**USER_PROBE, "periodSeconds": 15},
                    }
                ]
            },
        },
    },
}


def _render_component(folder: Path) -> tuple[Doc, ...]:
    """The Component on USER_DEPLOYMENT, through a kustomization of the user's own."""
    (folder / "deployment.yaml").write_text(yaml.safe_dump(USER_DEPLOYMENT))
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["deployment.yaml"],
        # kustomize takes a Component's folder by a relative path only.
        "components": [os.path.relpath(COMPONENT, folder)],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = subprocess.run(
        [str(kubectl()), "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize with {COMPONENT}: {result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


@dataclass(frozen=True, slots=True)
class Rendered:
    source: str  # a layer, or "component"
    docs: tuple[Doc, ...]

    @property
    def has_own_service(self) -> bool:
        """A layer brings its Service; with the Component, the Service is the user's."""
        return self.source != "component"


@pytest.fixture(scope="module", params=SOURCES)
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    source = request.param
    if source == "component":
        if not COMPONENT.is_dir():
            pytest.skip(
                f"{COMPONENT.relative_to(DEPLOY.parent)} (the sidecar as a kustomize Component) "
                "is not in this checkout"
            )
        return Rendered(source, _render_component(tmp_path_factory.mktemp("component")))
    if reason := missing_input(source):
        pytest.skip(reason)
    return Rendered(source, build(source))


def sidecar_pod(docs: tuple[Doc, ...]) -> Doc:
    """The pod template of the one Deployment that runs kvpilot."""
    (deployment,) = [
        d
        for d in of_kind(docs, "Deployment")
        if SIDECAR in {c["name"] for c in d["spec"]["template"]["spec"]["containers"]}
    ]
    return dict(deployment["spec"]["template"]["spec"])


def container(pod: Doc, name: str) -> Doc:
    (found,) = [c for c in pod["containers"] if c["name"] == name]
    return dict(found)


def all_containers(pod: Doc) -> list[Doc]:
    return [*(pod.get("initContainers") or ()), *pod["containers"]]


def test_kvpilot_has_no_probe_and_vllm_keeps_its(rendered: Rendered) -> None:
    """A pod is in a Service's endpoints only while every container is ready: a probe on
    kvpilot would let a stuck or restarting sidecar take vLLM out of serving."""
    pod = sidecar_pod(rendered.docs)
    sidecar = container(pod, SIDECAR)
    probes = ("readinessProbe", "livenessProbe", "startupProbe")
    assert [p for p in probes if p in sidecar] == []
    vllm = container(pod, VLLM)
    assert "readinessProbe" in vllm and "livenessProbe" in vllm
    if not rendered.has_own_service:
        user = USER_DEPLOYMENT["spec"]["template"]["spec"]["containers"][0]
        assert vllm["readinessProbe"] == user["readinessProbe"]
        assert vllm["livenessProbe"] == user["livenessProbe"]


def test_kvpilot_mounts_the_pods_token_and_leaves_vllms_as_it_was(rendered: Rendered) -> None:
    """The pod's own token settings stay (the Component sets no `automountServiceAccountToken`,
    so a vLLM that authenticates as its pod still can); no container but kvpilot's mounts the
    Component's projected token, at the usual path or any other."""
    pod = sidecar_pod(rendered.docs)
    assert "automountServiceAccountToken" not in pod
    token_volumes = {
        v["name"]
        for v in pod.get("volumes") or ()
        if any("serviceAccountToken" in s for s in (v.get("projected") or {}).get("sources", ()))
    }
    at_token_path = {
        c["name"]
        for c in all_containers(pod)
        for m in c.get("volumeMounts") or ()
        if PurePosixPath(m["mountPath"]) == PurePosixPath(TOKEN_PATH)
    }
    with_token_volume = {
        c["name"]
        for c in all_containers(pod)
        for m in c.get("volumeMounts") or ()
        if m["name"] in token_volumes
    }
    assert at_token_path == {SIDECAR} and with_token_volume == {SIDECAR}
    (mount,) = [m for m in container(pod, SIDECAR)["volumeMounts"] if m["name"] in token_volumes]
    assert mount["mountPath"] == TOKEN_PATH and mount.get("readOnly") is True


@pytest.mark.parametrize("layer", LAYERS)
def test_every_container_meets_pod_security_restricted(layer: str) -> None:
    if reason := missing_input(layer):
        pytest.skip(reason)
    pod = sidecar_pod(build(layer))
    assert len(all_containers(pod)) == 3  # the plugin's init container, vLLM, kvpilot
    assert restricted_violations(pod) == []


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    """Sets `a.b.c` in a pod spec; a container is named by its name (`vllm.ports`)."""

    def change(pod: Doc) -> None:
        head, *keys = path.split(".")
        names = {c["name"]: c for c in all_containers(pod)}
        target = names.get(head, pod)
        keys = keys if head in names else [head, *keys]
        for key in keys[:-1]:
            target = target.setdefault(key, {})
        if value is None:
            target.pop(keys[-1], None)
        else:
            target[keys[-1]] = value

    return change


def _add_volume(volume: Doc) -> Callable[[Doc], None]:
    return lambda pod: pod["volumes"].append(volume)


# One deliberately bad pod per control: the base's pod with one thing changed, and the one
# control that must catch it.
BAD_PODS: dict[str, tuple[Callable[[Doc], None], str]] = {
    "hostNetwork": (_set("hostNetwork", True), "Host Namespaces"),
    "hostPID": (_set("hostPID", True), "Host Namespaces"),
    "hostIPC": (_set("hostIPC", True), "Host Namespaces"),
    "privileged": (_set("vllm.securityContext.privileged", True), "Privileged Containers"),
    "CAP_KILL added": (_set("kvpilot.securityContext.capabilities.add", ["KILL"]), "Capabilities"),
    "drop ALL missing": (_set("kvpilot-init.securityContext.capabilities", {}), "Capabilities"),
    "hostPath": (
        _add_volume({"name": "models", "hostPath": {"path": "/models"}}),
        "HostPath Volumes",
    ),
    "nfs volume": (
        _add_volume({"name": "models", "nfs": {"server": "nfs", "path": "/models"}}),
        "Volume Types",
    ),
    "hostPort": (
        _set("vllm.ports", [{"name": "http", "containerPort": 8000, "hostPort": 8000}]),
        "Host Ports",
    ),
    "escalation unset": (
        _set("kvpilot-init.securityContext.allowPrivilegeEscalation", None),
        "Privilege Escalation",
    ),
    "escalation true": (
        _set("kvpilot.securityContext.allowPrivilegeEscalation", True),
        "Privilege Escalation",
    ),
    "no runAsNonRoot": (_set("securityContext.runAsNonRoot", None), "Running as Non-root"),
    "runAsNonRoot false": (
        _set("vllm.securityContext.runAsNonRoot", False),
        "Running as Non-root",
    ),
    "vLLM as root": (_set("vllm.securityContext.runAsUser", 0), "Running as Non-root user"),
    "pod as root": (_set("securityContext.runAsUser", 0), "Running as Non-root user"),
    "no seccomp": (_set("securityContext.seccompProfile", None), "Seccomp"),
    "seccomp Unconfined": (
        _set("vllm.securityContext.seccompProfile", {"type": "Unconfined"}),
        "Seccomp",
    ),
    "sysctls": (
        _set("securityContext.sysctls", [{"name": "net.core.somaxconn", "value": "1024"}]),
        "unchecked field",
    ),
    "procMount": (_set("vllm.securityContext.procMount", "Unmasked"), "unchecked field"),
}
# Changes the profile allows: the checker must pass them.
GOOD_PODS: dict[str, Callable[[Doc], None]] = {
    "NET_BIND_SERVICE added": _set(
        "kvpilot.securityContext.capabilities.add", ["NET_BIND_SERVICE"]
    ),
    "seccomp Localhost": _set(
        "securityContext.seccompProfile", {"type": "Localhost", "localhostProfile": "k.json"}
    ),
    "runAsNonRoot on every container instead": lambda pod: _non_root_per_container(pod),
}


def _non_root_per_container(pod: Doc) -> None:
    _set("securityContext.runAsNonRoot", None)(pod)
    for c in all_containers(pod):
        _set(f"{c['name']}.securityContext.runAsNonRoot", True)(pod)


def _base_pod() -> Doc:
    pod = copy.deepcopy(sidecar_pod(build("base")))
    # Named apart from kvpilot's, so that a change can address it.
    (init,) = pod["initContainers"]
    init["name"] = "kvpilot-init"
    return pod


@pytest.mark.parametrize("case", BAD_PODS)
def test_the_restricted_checker_catches_each_control(case: str) -> None:
    change, control = BAD_PODS[case]
    pod = _base_pod()
    change(pod)
    found = restricted_violations(pod)
    assert found and {v.control for v in found} == {control}, found


@pytest.mark.parametrize("case", GOOD_PODS)
def test_the_restricted_checker_passes_what_the_profile_allows(case: str) -> None:
    pod = _base_pod()
    GOOD_PODS[case](pod)
    assert restricted_violations(pod) == []


def _sidecar_config(docs: tuple[Doc, ...], tmp_path: Path) -> AgentConfig:
    """The settings the sidecar runs with: the ConfigMap's file that KVPILOT_CONFIG names
    through the container's mounts, with the container's KVPILOT_* overrides, loaded as
    `kvpilot run` loads them."""
    pod = sidecar_pod(docs)
    sidecar = container(pod, SIDECAR)
    env = {e["name"]: e["value"] for e in sidecar.get("env") or () if "value" in e}
    path = PurePosixPath(env["KVPILOT_CONFIG"])
    (mount,) = [m for m in sidecar["volumeMounts"] if path.parent == PurePosixPath(m["mountPath"])]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    name = volume["configMap"]["name"]
    (config_map,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"] == name]
    (tmp_path / path.name).write_text(config_map["data"][path.name])
    return load_config(tmp_path / path.name, env, warn=False)


def _service_ports(docs: tuple[Doc, ...], pod: Doc) -> dict[str, tuple[int, int]]:
    """Each Service port by name: (port, the container port it targets)."""
    named = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports") or ()}
    out = {}
    for service in of_kind(docs, "Service"):
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            out[port["name"]] = (port["port"], named.get(target, target))
    return out


def test_the_control_api_is_on_loopback_and_on_no_exposed_port(
    rendered: Rendered, tmp_path: Path
) -> None:
    config = _sidecar_config(rendered.docs, tmp_path)
    api = config.api.listen
    assert api is not None, "the control API shares the listener whose port the Service exposes"
    assert ipaddress.ip_address(api.host).is_loopback, api.host
    pod = sidecar_pod(rendered.docs)
    container_ports = {
        p["containerPort"] for c in all_containers(pod) for p in c.get("ports") or ()
    }
    service_ports = _service_ports(rendered.docs, pod)
    exposed = {n for pair in service_ports.values() for n in pair}
    assert api.port not in container_ports | exposed | {config.listen.port}
    if rendered.has_own_service:
        assert service_ports[SIDECAR] == (config.listen.port, config.listen.port)


def test_the_default_port_is_no_common_exporters() -> None:
    port = ListenConfig().port
    assert port != DCGM_EXPORTER_PORT and port not in EXPORTER_REGISTRY


def test_every_kvpilot_port_in_the_manifests_is_the_default(
    rendered: Rendered, tmp_path: Path
) -> None:
    default = ListenConfig().port
    pod = sidecar_pod(rendered.docs)
    assert {p["containerPort"] for p in container(pod, SIDECAR).get("ports") or ()} == {default}
    assert _sidecar_config(rendered.docs, tmp_path).listen.port == default
    if rendered.has_own_service:
        assert _service_ports(rendered.docs, pod)[SIDECAR] == (default, default)
        (monitor,) = of_kind(rendered.docs, "ServiceMonitor")
        assert SIDECAR in {e["port"] for e in monitor["spec"]["endpoints"]}
