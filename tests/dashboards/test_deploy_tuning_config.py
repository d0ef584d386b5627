"""The tuning overlay's ConfigMap: a valid object whose kvpilot.yaml `kvpilot config check`
accepts, with the pod runtime and scheduled tuning on."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import yaml
from typer.testing import CliRunner

from kvpilot.agent.cli.main import app
from kvpilot.agent.config import PodRuntimeConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
TUNING = ROOT / "deploy" / "overlays" / "tuning" / "kvpilot-config.yaml"
BASE = ROOT / "deploy" / "components" / "sidecar" / "kvpilot-config.yaml"
KUBERNETES_VERSION = "1.30.0"


def _config_map(path: Path) -> dict:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return doc


def test_it_replaces_the_base_config_map_and_validates() -> None:
    tuning, base = _config_map(TUNING), _config_map(BASE)
    kubernetes_validate.validate(tuning, KUBERNETES_VERSION, strict=True)
    assert (tuning["kind"], tuning["metadata"]["name"]) == (base["kind"], base["metadata"]["name"])
    assert set(tuning["data"]) == set(base["data"]) == {"kvpilot.yaml"}


def test_config_check_accepts_the_pod_runtime_with_tuning_on(tmp_path: Path) -> None:
    path = tmp_path / "kvpilot.yaml"
    path.write_text(_config_map(TUNING)["data"]["kvpilot.yaml"])

    result = CliRunner().invoke(app, ["config", "check", str(path), "--no-env"])

    assert result.exit_code == 0, result.output
    assert f"OK: {path}" in result.output
    assert "runtime: pod, vllm at http://127.0.0.1:8000, Deployment (the pod namespace)/vllm" in (
        result.output
    )
    config = load_config(path, None, warn=False)
    assert isinstance(config.runtime, PodRuntimeConfig)
    assert str(config.state_dir) == "/var/lib/kvpilot"
    assert config.tuning.schedule == "0 3 * * *"
    assert config.runtime.kubernetes.promote == "auto"
    assert config.runtime.kubernetes.restart == "signal"


def test_config_check_says_how_canaries_get_their_traffic(tmp_path: Path) -> None:
    path = tmp_path / "kvpilot.yaml"
    path.write_text(_config_map(TUNING)["data"]["kvpilot.yaml"])
    gateway = "{httproute: vllm, stable_service: vllm, canary_service: vllm-kvpilot-canary}"
    said = {}
    for traffic, extra in (
        ("replay", {}),
        ("service", {}),
        ("gateway", {"KVPILOT_TUNING__CANARY__GATEWAY": gateway}),
    ):
        env = {"KVPILOT_TUNING__CANARY__TRAFFIC": traffic, **extra}
        result = CliRunner().invoke(app, ["config", "check", str(path)], env=env)
        assert result.exit_code == 0, result.output
        (said[traffic],) = [x for x in result.output.splitlines() if x.startswith("tuning: ")]
    assert said["replay"] == (
        "tuning: schedule '0 3 * * *' (UTC), 3 trials a run, canaries on a synthetic replay "
        "(parallel)"
    )
    assert "live traffic through a share of the Service's endpoints: warm-up" in said["service"]
    assert "live traffic through HTTPRoute vllm weight 10 %" in said["gateway"]
