"""The sidecar Component on a Deployment shaped as KServe's controller makes one
(tests/dashboards/kserve/), checked statically: KServe's Deployments belong to its controller
and run vLLM through KServe's own server module, so the Component does not fit them, and
this shows why (docs/deploy.md, "Into the vLLM you already run", says what to do instead)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from kustomize_builds import kubectl

from kvpilot.collectors.vllm_argv import launch_form

FIXTURE = Path(__file__).resolve().parent / "kserve"


def _rendered() -> dict[str, Any]:
    result = subprocess.run(
        [str(kubectl()), "kustomize", str(FIXTURE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (deployment,) = [
        d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "Deployment"
    ]
    return dict(deployment)


def test_the_component_finds_no_vllm_container_in_a_kserve_predictor() -> None:
    containers = {c["name"]: c for c in _rendered()["spec"]["template"]["spec"]["containers"]}
    # The merge keys containers by name: with no container named vllm it adds a stub that has
    # the plugin's environment and no image, which no pod could run.
    assert "image" not in containers["vllm"] and "command" not in containers["vllm"]
    assert "PYTHONPATH" not in {e["name"] for e in containers["kserve-container"].get("env", [])}


def test_kserves_server_module_is_no_vllm_command_line_kvpilot_knows() -> None:
    """So the process runtime would need a cmdline_regex of its own to find it."""
    server = _rendered()["spec"]["template"]["spec"]["containers"]
    (kserve,) = [c for c in server if c["name"] == "kserve-container"]
    assert launch_form([*kserve["command"], *kserve["args"]]) is None


def test_the_controller_owns_the_predictor() -> None:
    owners = _rendered()["metadata"]["ownerReferences"]
    assert [o["kind"] for o in owners if o.get("controller")] == ["InferenceService"]
