"""The manifests as kustomize renders them, changed only where a pod on this machine must
differ. Every change is in CHANGES, with its reason; nothing else is touched."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpilot.rig.server import TINY_MODEL_DIR, ServerSpec, build_argv, free_port
from tests.dashboards.kustomize_builds import build, kubectl, post_rendered

Doc = dict[str, Any]

# (what changes, why), each done by one function below.
CHANGES = (
    ("only the Deployment and the ConfigMaps are played (`rendered`)",
     "podman plays Deployments and ConfigMaps; RBAC, the Service, the ServiceMonitor and the "
     "rules need an API server: tests/dashboards/ checks them statically"),
    ("the Deployment is named per test (`rename`)", "two tests may play pods at once"),
    ("every ConfigMap named per test, and the Deployment's references to it "
     "(`configmaps_apart`); its podman volume removed after the pod (`podman.played`)",
     "podman keeps a ConfigMap volume by the ConfigMap's name, across pods and after they go: "
     "two pods played at once, or one after another, read each other's kvpilot.yaml"),
    ("image references: the kvpilot image built from the Dockerfile here, the Debian base "
     "for vLLM (`set_images`)",
     "no registry is reachable here, and no vLLM image needs building"),
    ("the vLLM container runs the suite's virtualenv and interpreter, mounted read-only, on "
     "the tiny random-weight model, with the CPU build's flags (`run_vllm_from_the_suite`)",
     "no GPU and no model download here"),
    ("`hostNetwork: true`, every port a free loopback port, the containers' port lists "
     "dropped and probes given port numbers (`host_network`, `loopback_listeners`)",
     "podman's default bridge is a private address range, where no traffic may go"),
    ("`nvidia.com/gpu` dropped from vLLM's resources (`run_vllm_from_the_suite`)",
     "no GPU here"),
    ("the projected service-account token dropped from kvpilot's container "
     "(`drop_projected_token`)",
     "no API server issues tokens here"),
    ("the downward API's `metadata.namespace` and `status.podIP` given as plain values "
     "(`namespace_as_value`)",
     "podman runs no namespaces and refuses those fields; the pod's address is loopback here"),
    ("every emptyDir a podman volume of its own through a claim, a tmpfs owned by the pod's "
     "UID; a claim renamed per test (`emptydirs_as_volumes`, `podman.Volumes`)",
     "podman 4.3 mounts emptyDirs root-owned 0755, which a non-root container cannot write "
     "(Kubernetes makes them world-writable), and its own /dev/shm (64 MiB) is too small for "
     "vLLM's 160 MiB"),
    ("vLLM's PYTHONPATH also holds rig/amx, mounted read-only (`run_vllm_from_the_suite`)",
     "vLLM 0.32's CPU attention runs AMX tile instructions without asking Linux for them: "
     "rig/amx/sitecustomize.py asks, as for every server the suite starts"),
    ("the init containers run, as rendered, in a pod of their own just before, on the same "
     "volumes (`init_containers_apart`)",
     "podman 4.3 gives init containers the pod's restart policy: it restarts the finished "
     "init container at once, then fails to remove it ('cannot remove container ... as it "
     "is running')"),
    ("a /dev/shm emptyDir for a vLLM container that has none (`shm_for_the_cpu_build`)",
     "the CPU build always runs its worker in a process of its own, which needs 160 MiB of "
     "shared memory; production-stack's chart mounts one only with tensor parallelism, which "
     "the GPU build needs it for"),
    ("tuning overlay: vLLM's container runs the stand-in server (tests/fakes/"
     "standin_vllm_module.py) with the shipped command; kvpilot's runtime is given the fake "
     "API server's address (`KVPILOT_RUNTIME__KUBERNETES__API_URL`) (test_tuning_pod.py)",
     "no Kubernetes API server can run here: the fake stands in, named as such"),
    ("kvpilot.yaml: the rule's action `restart` and a webhook notifier (`edit_config`)",
     "the shipped default action is the ladder, and the shipped config notifies no one"),
)  # fmt: skip
PLAYED_KINDS = {"Deployment", "ConfigMap"}
PROJECTED_TOKEN = "kube-api-access"
AMX_REQUEST = TINY_MODEL_DIR.resolve().parents[1] / "amx"  # rig/amx


@dataclass(frozen=True, slots=True)
class PodPorts:
    """Free loopback ports for one pod's servers."""

    vllm: int = field(default_factory=free_port)
    kvpool: int = field(default_factory=free_port)
    metrics: int = field(default_factory=free_port)
    api: int = field(default_factory=free_port)


def suite_python_mounts() -> list[tuple[str, Path]]:
    """The virtualenv, the interpreter it was made from, and the tiny model: (name, path)."""
    return [
        ("suite-venv", Path(sys.prefix)),
        ("suite-python", Path(sys.base_prefix)),
        ("tiny-model", TINY_MODEL_DIR.resolve()),
        ("amx-request", AMX_REQUEST),
    ]


def pod_spec(deployment: Doc) -> Doc:
    return deployment["spec"]["template"]["spec"]


def container(deployment: Doc, name: str) -> Doc:
    (found,) = [c for c in pod_spec(deployment)["containers"] if c["name"] == name]
    return found


def set_env(target: Doc, name: str, value: str) -> None:
    env = [e for e in target.get("env", []) if e["name"] != name]
    target["env"] = [*env, {"name": name, "value": value}]


def rename(docs: list[Doc], name: str) -> None:
    for doc in docs:
        if doc["kind"] == "Deployment":
            doc["metadata"]["name"] = name


def set_images(docs: list[Doc], kvpilot: str, base: str) -> None:
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        spec = pod_spec(doc)
        for each in [*spec.get("initContainers", []), *spec["containers"]]:
            each["image"] = kvpilot if "kvpilot" in each["image"] else base


def run_vllm_from_the_suite(
    deployment: Doc, ports: PodPorts, *, name: str = "vllm", marker: str, kv_bytes: int
) -> None:
    """The vLLM container: the suite's interpreter on the tiny model, the CPU build's flags,
    the shipped `--shutdown-timeout` kept; the plugin still comes from the init container
    through PYTHONPATH as shipped."""
    vllm = container(deployment, name)
    spec = ServerSpec(
        port=ports.vllm,
        served_model_name=marker,
        kv_cache_memory_bytes=kv_bytes,
        shutdown_timeout_s=5,
    )
    python = str(Path(sys.prefix) / "bin" / "python")
    argv = build_argv(spec, python=python)
    vllm["command"], vllm["args"] = argv[:3], argv[3:]
    shipped = {e["name"]: e.get("value") for e in vllm.get("env", [])}.get("PYTHONPATH")
    for var, value in {
        "PYTHONPATH": ":".join(p for p in (shipped, str(AMX_REQUEST)) if p),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "KVPILOT_KVPOOL_PORT": str(ports.kvpool),
    }.items():
        set_env(vllm, var, value)
    for port in vllm.get("ports", []):
        port["containerPort"] = {"http": ports.vllm, "kvpool": ports.kvpool}.get(
            port["name"], port["containerPort"]
        )
    _mount_host_paths(deployment, vllm)
    _drop_gpu(vllm)


def _mount_host_paths(deployment: Doc, target: Doc) -> None:
    spec = pod_spec(deployment)
    for name, path in suite_python_mounts():
        spec["volumes"].append({"name": name, "hostPath": {"path": str(path), "type": "Directory"}})
        target.setdefault("volumeMounts", []).append(
            {"name": name, "mountPath": str(path), "readOnly": True}
        )


def _drop_gpu(target: Doc) -> None:
    for key in ("requests", "limits"):
        target.get("resources", {}).get(key, {}).pop("nvidia.com/gpu", None)


def shm_for_the_cpu_build(deployment: Doc) -> None:
    vllm = container(deployment, "vllm")
    if any(m["mountPath"] == "/dev/shm" for m in vllm.get("volumeMounts", [])):
        return
    pod_spec(deployment).setdefault("volumes", []).append(
        {"name": "cpu-build-shm", "emptyDir": {"medium": "Memory"}}
    )
    vllm.setdefault("volumeMounts", []).append({"name": "cpu-build-shm", "mountPath": "/dev/shm"})


def host_network(deployment: Doc) -> None:
    """Host networking; the containers' port lists go (podman 4.3 refuses port mappings
    beside host networking), their probes keep the same ports by number."""
    spec = pod_spec(deployment)
    spec["hostNetwork"] = True
    for each in [*spec.get("initContainers", []), *spec["containers"]]:
        numbers = {p["name"]: p["containerPort"] for p in each.pop("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            action = each.get(probe, {}).get("httpGet")
            if action is not None:
                action["port"] = numbers.get(action["port"], action["port"])


def emptydirs_as_volumes(deployment: Doc, prefix: str) -> list[str]:
    """Every emptyDir of `deployment` a claim on the podman volume PREFIX-NAME; returns the
    volumes' names, which the caller creates (`podman.Volumes`) and removes."""
    claims = []
    for volume in pod_spec(deployment)["volumes"]:
        if "emptyDir" in volume or "persistentVolumeClaim" in volume:
            volume.pop("emptyDir", None)
            claim = f"{prefix}-{volume['name']}"
            volume["persistentVolumeClaim"] = {"claimName": claim}
            claims.append(claim)
    return claims


def init_containers_apart(deployment: Doc, name: str) -> tuple[Doc, set[str]]:
    """Takes the init containers out of `deployment` into a Pod of their own, `name`, with the
    same pod securityContext and the volumes they mount; returns it and the claims of those
    volumes (which must outlive the init containers)."""
    spec = pod_spec(deployment)
    inits = spec.pop("initContainers")
    mounted = {m["name"] for each in inits for m in each.get("volumeMounts", [])}
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in spec["volumes"]
        if v["name"] in mounted and "persistentVolumeClaim" in v
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": spec.get("securityContext", {}),
            "containers": inits,
            "volumes": [v for v in spec["volumes"] if v["name"] in mounted],
        },
    }, claims


def namespace_as_value(deployment: Doc, namespace: str = "default") -> None:
    spec = pod_spec(deployment)
    for each in [*spec.get("initContainers", []), *spec["containers"]]:
        for var in each.get("env", []):
            field_ref = var.get("valueFrom", {}).get("fieldRef", {})
            value = {"metadata.namespace": namespace, "status.podIP": "127.0.0.1"}.get(
                field_ref.get("fieldPath", "")
            )
            if value is not None:
                del var["valueFrom"]
                var["value"] = value


def drop_projected_token(deployment: Doc) -> None:
    spec = pod_spec(deployment)
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != PROJECTED_TOKEN]
    for each in spec["containers"]:
        mounts = [m for m in each.get("volumeMounts", []) if m["name"] != PROJECTED_TOKEN]
        each["volumeMounts"] = mounts


def edit_config(docs: list[Doc], edit: Callable[[Doc], None], name: str = "kvpilot-config") -> Doc:
    """kvpilot.yaml inside the ConfigMap, changed by `edit`; returns the result."""
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
    config = yaml.safe_load(config_map["data"]["kvpilot.yaml"])
    edit(config)
    config_map["data"]["kvpilot.yaml"] = yaml.safe_dump(config, sort_keys=False)
    return config


def loopback_listeners(config: Doc, ports: PodPorts) -> None:
    config["listen"] = {"host": "127.0.0.1", "port": ports.metrics}
    config["api"] = {**config.get("api", {}), "listen": f"127.0.0.1:{ports.api}"}
    config["runtime"].update(port=ports.vllm, kvpool_port=ports.kvpool)


def rendered(layer: str) -> list[Doc]:
    """`kubectl kustomize` of a layer, the kinds a pod here plays, as fresh copies."""
    return [copy.deepcopy(d) for d in build(layer) if d["kind"] in PLAYED_KINDS]


def rendered_folder(folder: Path) -> list[Doc]:
    """`kubectl kustomize FOLDER` (a user's kustomization), the kinds a pod here plays."""
    result = subprocess.run(
        [str(kubectl()), "kustomize", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"kubectl kustomize {folder}: {result.stderr}"
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    return [d for d in docs if d["kind"] in PLAYED_KINDS]


def post_rendered_chart(chart: Path, *args: str) -> list[Doc]:
    """A chart's rendered output (`chart`) through deploy/helm's post-renderer, as Helm runs
    it; the kinds a pod here plays."""
    docs = post_rendered(chart.read_text(), *args)
    return [copy.deepcopy(d) for d in docs if d["kind"] in PLAYED_KINDS]


def write(docs: list[Doc], path: Path) -> Path:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def unique_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{free_port()}"


@dataclass(frozen=True, slots=True)
class PodHere:
    """A rendered Deployment made playable here: the docs to play, the init containers' pod,
    and the podman volumes both use (those the init containers fill among them)."""

    docs: list[Doc]
    init_pod: Doc
    volumes: list[str]
    filled: set[str]
    config_maps: list[str]


def pod_here(
    docs: list[Doc],
    name: str,
    *,
    kvpilot_image: str,
    base_image: str,
    ports: PodPorts,
    kv_bytes: int,
    edit: Callable[[Doc], None],
) -> PodHere:
    """Every change in CHANGES, on the one Deployment in `docs`, named `name`; `edit` then
    changes kvpilot.yaml (after its listeners are moved to `ports`)."""
    rename(docs, name)
    set_images(docs, kvpilot=kvpilot_image, base=base_image)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    run_vllm_from_the_suite(deployment, ports, marker=name, kv_bytes=kv_bytes)
    shm_for_the_cpu_build(deployment)
    host_network(deployment)
    drop_projected_token(deployment)
    namespace_as_value(deployment)
    volumes = emptydirs_as_volumes(deployment, name)
    init_pod, filled = init_containers_apart(deployment, f"{name}-init")

    def edit_all(config: Doc) -> None:
        loopback_listeners(config, ports)
        edit(config)

    edit_config(docs, edit_all)
    config_maps = configmaps_apart(docs, name)
    return PodHere(docs, init_pod, volumes, filled, config_maps)


def configmaps_apart(docs: list[Doc], prefix: str) -> list[str]:
    """Every ConfigMap in `docs` renamed `prefix-NAME`, and every reference to it in the
    Deployments' pods (volumes, projected sources, env and envFrom); returns the new names."""
    renamed = {
        doc["metadata"]["name"]: f"{prefix}-{doc['metadata']['name']}"
        for doc in docs
        if doc["kind"] == "ConfigMap"
    }
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            doc["metadata"]["name"] = renamed[doc["metadata"]["name"]]
        elif doc["kind"] == "Deployment":
            spec = pod_spec(doc)
            refs = [v.get("configMap") for v in spec.get("volumes", [])]
            for volume in spec.get("volumes", []):
                refs += [p.get("configMap") for p in volume.get("projected", {}).get("sources", [])]
            for each in [*spec.get("initContainers", []), *spec["containers"]]:
                refs += [e.get("valueFrom", {}).get("configMapKeyRef") for e in each.get("env", [])]
                refs += [e.get("configMapRef") for e in each.get("envFrom", [])]
            for ref in refs:
                if ref is not None and ref.get("name") in renamed:
                    ref["name"] = renamed[ref["name"]]
    return list(renamed.values())
