"""deploy/ built with `kubectl kustomize` (base, tuning, tuning-gateway), and every object checked.

Core kinds with kubernetes-validate (strict), the HTTPRoute with the Gateway API's published
schema, the sidecar's kvpilot.yaml with `kvpilot config check`, and what each overlay is
for: the state the pod's own, the Service's selector against the canary's labels as the
runtime builds them, the route's stable backend.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kustomize_builds import LAYERS, ROOT, build, kubectl, missing_input, named, of_kind
from typer.testing import CliRunner

from kvpilot.agent.cli.main import app
from kvpilot.agent.config import load_config
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes import objects, traffic

KUBERNETES_VERSION = "1.30.0"
CORE_KINDS = {
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "Service",
    "Deployment",
    "PersistentVolumeClaim",
}
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}  # prometheus-operator's; promtool checks
GATEWAY_KINDS = {"HTTPRoute"}
KINDS = {
    "base": CORE_KINDS - {"PersistentVolumeClaim"} | OPERATOR_KINDS,
    "tuning": CORE_KINDS - {"PersistentVolumeClaim"} | OPERATOR_KINDS,
    "tuning-gateway": CORE_KINDS - {"PersistentVolumeClaim"} | OPERATOR_KINDS | GATEWAY_KINDS,
}
# The names the runtime's `tuning.canary.gateway` settings use.
HTTPROUTE, STABLE_SERVICE, CANARY_SERVICE = "vllm", "vllm", "vllm-kvpilot-canary"
STATE_DIR = "/var/lib/kvpilot"


def built(layer: str) -> tuple[dict[str, Any], ...]:
    if reason := missing_input(layer):
        pytest.skip(reason)
    return build(layer)


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_builds_with_its_kinds_labels_and_images(layer: str) -> None:
    docs = built(layer)
    assert {d["kind"] for d in docs} == KINDS[layer]
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names))
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvpilot", doc["kind"]
    pod = named(docs, "Deployment", "vllm")["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    # The sidecar's tag is the package's version: pyproject.toml is where it is written.
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert images == {"vllm/vllm-openai:v0.32.0", f"ghcr.io/kvpilot/kvpilot:{version}"}


@pytest.mark.parametrize("layer", LAYERS)
def test_vllm_stays_the_pods_first_container(layer: str) -> None:
    """Patches by index (the docs' example) and `kubectl logs` without -c mean vLLM."""
    pod = named(built(layer), "Deployment", "vllm")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["vllm", "kvpilot"]
    assert pod["containers"][0]["args"][0].startswith("--model=")


def test_the_deploy_pages_example_overlay_builds(tmp_path: Path) -> None:
    """docs/deploy.md's own overlay, put beside the others, sets namespace, image and model."""
    if reason := missing_input("tuning"):
        pytest.skip(reason)
    page = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"```yaml\n(# deploy/overlays/prod/kustomization.yaml\n.*?)```", page, re.S)
    assert block is not None
    copy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", copy)
    (copy / "overlays" / "prod").mkdir()
    (copy / "overlays" / "prod" / "kustomization.yaml").write_text(block.group(1))
    result = subprocess.run(
        [str(kubectl()), "kustomize", str(copy / "overlays" / "prod")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    docs = tuple(d for d in yaml.safe_load_all(result.stdout) if d)
    assert {d["metadata"].get("namespace") for d in docs} == {"serving"}
    pod = named(docs, "Deployment", "vllm")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert containers["vllm"]["args"][0] == "--model=meta-llama/Llama-3.1-8B-Instruct"
    assert containers["kvpilot"]["args"][0] == "run"
    assert containers["kvpilot"]["image"] == "registry.example.com/kvpilot:0.1.0"


@pytest.mark.parametrize("layer", LAYERS)
def test_core_kinds_pass_kubernetes_validate_strict(layer: str) -> None:
    checked = set()
    for doc in built(layer):
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            checked.add(doc["kind"])
    assert checked == KINDS[layer] & CORE_KINDS


def test_httproute_passes_the_gateway_api_schema() -> None:
    try:
        schema = importlib.import_module("tests.fakes.gateway_schema")
    except ModuleNotFoundError:
        pytest.skip(
            "tests/fakes/gateway_schema.py (the Gateway API's published HTTPRoute schema) "
            "is not in this checkout"
        )
    route = named(built("tuning-gateway"), "HTTPRoute", HTTPROUTE)
    assert schema.validate_httproute(route) == []
    broken = {**route, "spec": {**route["spec"], "rules": [{"backendRefs": [{"weight": -1}]}]}}
    assert schema.validate_httproute(broken) != []


TRAFFIC = {"base": "replay", "tuning": "service", "tuning-gateway": "gateway"}


@pytest.mark.parametrize("layer", LAYERS)
def test_config_check_accepts_the_sidecars_settings(
    layer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ConfigMap's kvpilot.yaml with the sidecar container's KVPILOT_* overrides, as the
    pod runs it: `kvpilot config check` accepts it, and each overlay judges canaries on the
    traffic its Service or HTTPRoute gives them."""
    docs = built(layer)
    path = tmp_path / "kvpilot.yaml"
    path.write_text(named(docs, "ConfigMap", "kvpilot-config")["data"]["kvpilot.yaml"])
    pod = named(docs, "Deployment", "vllm")["spec"]["template"]["spec"]
    (sidecar,) = [c for c in pod["containers"] if c["name"] == "kvpilot"]
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    for name in [n for n in os.environ if n.startswith("KVPILOT_")]:
        monkeypatch.delenv(name)
    result = CliRunner().invoke(app, ["config", "check", str(path)], env=env)
    assert result.exit_code == 0, result.output
    config = load_config(path, env, warn=False)
    assert str(config.state_dir) == STATE_DIR
    assert config.runtime.kind == ("process" if layer == "base" else "pod")
    canary = config.tuning.canary
    assert canary.traffic == TRAFFIC[layer]
    if layer == "tuning-gateway":
        gateway = canary.gateway
        assert gateway is not None
        assert gateway.httproute == HTTPROUTE and gateway.stable_service == STABLE_SERVICE
        assert gateway.canary_service == CANARY_SERVICE


def _canary(deployment: dict[str, Any], serve: dict[str, str] | None = None) -> dict[str, Any]:
    """The canary Deployment the runtime builds from this stable one."""
    stable = {**deployment, "metadata": {**deployment["metadata"], "uid": "0"}}
    return objects.build_canary(
        stable,
        container="vllm",
        command=objects.ContainerCommand(None, ("--model=candidate",)),
        sidecar_container="kvpilot",
        serve_labels=serve,
    )


def _canary_pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return dict(_canary(deployment)["spec"]["template"]["metadata"]["labels"])


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _service_share_labels(service: dict[str, Any], canary: dict[str, Any]) -> dict[str, str]:
    """What the runtime's Service share asks of this Service (its own checks, its answer)."""
    share = traffic.ServiceShare(
        None,
        namespace="serving",
        service=service["metadata"]["name"],
        canary_selector=canary["spec"]["selector"]["matchLabels"],
    )

    async def read(name: str) -> dict[str, Any]:
        return service  # the built object, where the API server would return it

    share._api.service = read  # type: ignore[method-assign]
    return asyncio.run(share.canary_labels())


def test_tuning_service_shares_live_traffic_with_the_canary() -> None:
    """The Service selects stable and canary pods, and a label of its own (no Deployment
    selects on it) takes the canary's pods out again while their ReplicaSet keeps them."""
    docs = built("tuning")
    deployment = named(docs, "Deployment", "vllm")
    service = named(docs, "Service", STABLE_SERVICE)
    labels = _service_share_labels(service, _canary(deployment))
    assert labels == service["spec"]["selector"]
    canary = _canary(deployment, serve=labels)
    pod = canary["spec"]["template"]["metadata"]["labels"]
    assert _selects(labels, deployment["spec"]["template"]["metadata"]["labels"])
    assert _selects(labels, pod) and pod[objects.ROLE_LABEL] == "canary"
    own = {k for k in labels if k not in canary["spec"]["selector"]["matchLabels"]}
    # The canary's pods carry none of the stable's labels unless asked: every label the
    # Service selects on is one the pull-back may take off.
    assert own == set(labels) and "kvpilot.dev/serving" in own
    pulled_back = {k: v for k, v in pod.items() if k not in own}
    assert not _selects(labels, pulled_back)
    assert _selects(canary["spec"]["selector"]["matchLabels"], pulled_back)
    assert not _selects(deployment["spec"]["selector"]["matchLabels"], pod)


@pytest.mark.parametrize("layer", ["base", "tuning-gateway"])
def test_other_services_keep_canaries_out(layer: str) -> None:
    """The base selects stable pods only; with the Gateway API the route's weights split,
    so the stable backend `vllm` is stable pods only, and a Service share is refused."""
    docs = built(layer)
    deployment = named(docs, "Deployment", "vllm")
    service = named(docs, "Service", STABLE_SERVICE)
    selector = service["spec"]["selector"]
    assert _selects(selector, deployment["spec"]["template"]["metadata"]["labels"])
    assert not _selects(selector, _canary_pod_labels(deployment))
    with pytest.raises(RuntimeFailure, match=objects.ROLE_LABEL):
        _service_share_labels(service, _canary(deployment))


@pytest.mark.parametrize("layer", ["tuning", "tuning-gateway"])
def test_tuning_state_is_the_pods_own_for_any_number_of_replicas(layer: str) -> None:
    """No ReadWriteOnce claim that replicas on other nodes cannot mount: the state directory
    is the pod's emptyDir, a promotion's handover goes through a ConfigMap, and the
    Deployment keeps its replicas and rolling update."""
    docs = built(layer)
    spec = named(docs, "Deployment", "vllm")["spec"]
    assert "strategy" not in spec  # a rolling update, no Recreate for a claim's sake
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    assert volumes["state"] == {"name": "state", "emptyDir": {}}
    assert not of_kind(docs, "PersistentVolumeClaim")
    containers = {c["name"]: c for c in spec["template"]["spec"]["containers"]}
    mounts = {m["name"]: m for m in containers["kvpilot"]["volumeMounts"]}
    assert mounts["state"]["mountPath"] == STATE_DIR
    # The planner reads the model's config.json from the Hugging Face cache, read-only.
    assert mounts["cache"] == {"name": "cache", "mountPath": "/cache", "readOnly": True}
    env = {e["name"]: e.get("value") for e in containers["kvpilot"]["env"]}
    assert env["HF_HOME"] == "/cache/huggingface"
    sidecar = yaml.safe_load(named(docs, "ConfigMap", "kvpilot-config")["data"]["kvpilot.yaml"])
    assert sidecar["runtime"]["kubernetes"]["handover"] == "configmap"


def test_base_state_is_the_pods_own() -> None:
    docs = built("base")
    spec = named(docs, "Deployment", "vllm")["spec"]
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    assert volumes["state"] == {"name": "state", "emptyDir": {}}
    assert "strategy" not in spec and not of_kind(docs, "PersistentVolumeClaim")


def test_gateway_route_sends_everything_to_the_stable_service() -> None:
    docs = built("tuning-gateway")
    route = named(docs, "HTTPRoute", HTTPROUTE)
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    service = named(docs, "Service", STABLE_SERVICE)
    http = {p["name"]: p["port"] for p in service["spec"]["ports"]}["http"]
    assert backends == [{"name": STABLE_SERVICE, "port": http, "weight": 100}]
    # The canary's Service exists only while a canary runs: the runtime creates it.
    assert CANARY_SERVICE not in {d["metadata"]["name"] for d in of_kind(docs, "Service")}


@pytest.mark.parametrize("layer", ["tuning", "tuning-gateway"])
def test_canary_pods_stay_out_of_the_vllm_scrape_job(layer: str) -> None:
    """With the Service over canary pods too, the `vllm` job drops them by their role label,
    as Prometheus names pod labels in service discovery."""
    monitor = named(built(layer), "ServiceMonitor", "vllm")
    endpoints = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    source = "__meta_kubernetes_pod_label_" + re.sub(r"\W", "_", objects.ROLE_LABEL)
    drops = [r for r in endpoints["http"]["relabelings"] if r.get("action") == "drop"]
    assert drops == [{"action": "drop", "regex": "canary", "sourceLabels": [source]}]
    canary = _canary_pod_labels(named(built(layer), "Deployment", "vllm"))
    assert re.fullmatch(drops[0]["regex"], canary[objects.ROLE_LABEL])


def test_the_canary_pages_settings_are_valid(tmp_path: Path) -> None:
    """docs/canary.md's `tuning.canary` example, on the pod runtime, passes config check."""
    page = (ROOT / "docs" / "canary.md").read_text()
    block = re.search(r"## Settings\n\n```yaml\n(.*?)```", page, re.S)
    assert block is not None
    data = yaml.safe_load(block.group(1))
    data |= {"state_dir": STATE_DIR, "runtime": {"kind": "pod", "port": 8000}}
    path = tmp_path / "kvpilot.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["config", "check", str(path), "--no-env"])
    assert result.exit_code == 0, result.output
    assert load_config(path, None, warn=False).tuning.canary.traffic == "gateway"
