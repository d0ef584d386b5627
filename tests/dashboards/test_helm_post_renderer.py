"""deploy/helm: the post-renderer Helm 3 runs by path and Helm 4 by its plugin's name, fed the
production-stack fixture's chart output (tests/pods/production_stack/) as Helm feeds it. No
helm binary can be had here: the executable runs as a real process, the plugin manifest is
checked statically. tests/pods/test_injected_pod.py plays the same output as a real pod."""

from __future__ import annotations

import os
import subprocess
import tomllib
from typing import Any

import yaml

from tests.dashboards.kustomize_builds import DEPLOY, ROOT, kubectl, post_render, post_rendered

FIXTURE = ROOT / "tests" / "pods" / "production_stack"
CHART_OUTPUT = FIXTURE / "vllm-deployment.yaml"  # what `helm template` hands the post-renderer
KVPILOT_UID = "--kvpilot-uid=0"  # the chart's vLLM runs as root
CHART_ACCOUNT = "vllm-weights-reader"
CHART_PYTHONPATH = "/opt/model-extras"
PLUGIN = DEPLOY / "helm" / "plugin.yaml"
Docs = dict[tuple[str, str], dict[str, Any]]


def _by_name(docs: tuple[dict[str, Any], ...]) -> Docs:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _env(deployment: dict[str, Any], container: str) -> dict[str, str | None]:
    (found,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == container
    ]
    return {e["name"]: e.get("value") for e in found.get("env") or ()}


def test_the_post_renderer_and_the_component_give_the_same_documents() -> None:
    """Helm's path (the post-renderer over the chart's output) and kustomize's (the user's
    kustomization beside it, with the Component) are one implementation: the same pod, RBAC,
    settings."""
    kustomized = subprocess.run(
        [str(kubectl()), "kustomize", str(FIXTURE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert kustomized.returncode == 0, kustomized.stderr
    by_kustomize = _by_name(tuple(d for d in yaml.safe_load_all(kustomized.stdout) if d))
    by_helm = _by_name(post_rendered(CHART_OUTPUT.read_text(), KVPILOT_UID))
    assert set(by_helm) == set(by_kustomize)
    assert by_helm == by_kustomize


def test_injection_keeps_vllms_identity_and_adds_to_its_pythonpath() -> None:
    docs = _by_name(post_rendered(CHART_OUTPUT.read_text(), KVPILOT_UID))
    deployment = docs[("Deployment", "vllm-tiny-deployment-vllm")]  # the chart's name, kept
    spec = deployment["spec"]["template"]["spec"]
    assert spec["shareProcessNamespace"] is True
    assert [c["name"] for c in spec["initContainers"]] == ["kvpool-plugin"]
    # vLLM's identity: the pod's own account and the token settings the chart gave (none).
    assert spec["serviceAccountName"] == CHART_ACCOUNT
    assert "automountServiceAccountToken" not in spec
    assert docs[("RoleBinding", "kvpilot")]["subjects"] == [
        {"kind": "ServiceAccount", "name": CHART_ACCOUNT}
    ]
    assert not [name for kind, name in docs if kind == "ServiceAccount"]
    env = _env(deployment, "vllm")
    assert env["PYTHONPATH"] == f"/opt/kvpilot-plugin:{CHART_PYTHONPATH}"
    assert env["HF_HOME"] == "/tmp"  # the chart's environment stays
    (kvpilot,) = [c for c in spec["containers"] if c["name"] == "kvpilot"]
    assert kvpilot["securityContext"]["runAsUser"] == 0
    assert kvpilot["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # kvpilot mounts the account's token itself, whatever the pod's automount says.
    mounts = {m["name"]: m["mountPath"] for m in kvpilot["volumeMounts"]}
    assert mounts["kube-api-access"] == "/var/run/secrets/kubernetes.io/serviceaccount"


def _bare_chart() -> str:
    """The fixture's Deployment without an account or a PYTHONPATH of its own, beside a
    Deployment nobody annotated (production-stack's router)."""
    (deployment,) = yaml.safe_load_all(CHART_OUTPUT.read_text())
    spec = deployment["spec"]["template"]["spec"]
    del spec["serviceAccountName"]
    vllm = spec["containers"][0]
    vllm["env"] = [e for e in vllm["env"] if e["name"] != "PYTHONPATH"]
    router = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm-deployment-router"},
        "spec": {
            "selector": {"matchLabels": {"app": "router"}},
            "template": {
                "metadata": {"labels": {"app": "router"}},
                "spec": {"containers": [{"name": "router", "image": "lmcache/router"}]},
            },
        },
    }
    return yaml.safe_dump_all([deployment, router])


def test_a_bare_chart_gets_no_empty_path_entry_and_binds_the_default_account() -> None:
    docs = _by_name(post_rendered(_bare_chart()))
    env = _env(docs[("Deployment", "vllm-tiny-deployment-vllm")], "vllm")
    assert env["PYTHONPATH"] == "/opt/kvpilot-plugin"  # no empty entry: no working directory
    assert docs[("RoleBinding", "kvpilot")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "default"}
    ]
    router = docs[("Deployment", "vllm-deployment-router")]
    assert [c["name"] for c in router["spec"]["template"]["spec"]["containers"]] == ["router"]


def test_output_without_an_annotated_deployment_is_refused_with_a_reason() -> None:
    (deployment,) = yaml.safe_load_all(CHART_OUTPUT.read_text())
    del deployment["metadata"]["annotations"]
    result = post_render(yaml.safe_dump(deployment))
    assert result.returncode != 0 and result.stdout == ""
    assert "kvpilot.dev/inject" in result.stderr and "Traceback" not in result.stderr


def test_the_helm_4_plugin_runs_the_post_renderer() -> None:
    plugin = yaml.safe_load(PLUGIN.read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert {k: plugin[k] for k in ("apiVersion", "type", "runtime", "version")} == {
        "apiVersion": "v1",
        "type": "postrenderer/v1",
        "runtime": "subprocess",
        "version": version,
    }
    assert plugin["name"] == "kvpilot"  # what `--post-renderer` names
    (command,) = plugin["runtimeConfig"]["platformCommand"]
    assert command["command"].startswith("${HELM_PLUGIN_DIR}/")
    executable = PLUGIN.parent / command["command"].removeprefix("${HELM_PLUGIN_DIR}/")
    assert executable.is_file() and os.access(executable, os.X_OK)
    assert executable.read_text().startswith("#!/usr/bin/env python3\n")
