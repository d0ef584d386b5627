"""The generated Prometheus rules: promtool accepts them, and they fire when they should."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import typer
import yaml
from prometheus_server import PROMTOOL
from typer.testing import CliRunner

from kvpilot.agent.cli.dashboards_cmd import register, runbooks
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.dashboards.rules import build_rules

HERE = Path(__file__).resolve().parent
ENGINE_ALERTS = {
    "KvFragmentationHigh",
    "PreemptionSpike",
    "KvCacheSaturated",
    "EngineStalled",
    "GpuMemoryGrowth",
}
SELF_ALERTS = {
    "KvpilotAbsent",
    "KvpilotCollectorDown",
    "KvpilotOutboxBacklog",
    "KvpilotRemediationCircuitOpen",
}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


def _alerts(groups: list[dict]) -> list[dict]:
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_check_rules_accepts_the_generated_rules(tmp_path: Path) -> None:
    path = tmp_path / "kvpilot.rules.yaml"
    path.write_text(build_rules(RulesConfig(), runbooks=runbooks()).rules_file())
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout


def test_every_agent_alert_and_self_watch_alert_is_generated() -> None:
    groups = yaml.safe_load(build_rules(RulesConfig()).rules_file())["groups"]
    names = {rule["alert"] for rule in _alerts(groups)}
    assert names == ENGINE_ALERTS | SELF_ALERTS


def test_rules_follow_the_configuration() -> None:
    config = RulesConfig.model_validate(
        {
            "fragmentation": {
                "kv_blocks": {"threshold_ratio": 0.45, "for_s": 30, "labels": {"team": "ml"}},
                "allocator": {"enabled": False},
            },
            "preemption_spike": {"window_s": 60, "baseline_window_s": 900, "floor_per_s": 0.5},
            "engine_stall": {"stall_s": 90, "severity": "warning"},
        }
    )
    alerts = _alerts(yaml.safe_load(build_rules(config).rules_file())["groups"])
    frag = [a for a in alerts if a["alert"] == "KvFragmentationHigh"]
    assert len(frag) == 1  # the allocator rule is disabled
    assert frag[0]["expr"] == 'kvpilot_fragmentation_ratio{source="kv_blocks"} > 0.45'
    assert frag[0]["for"] == "30s"
    assert frag[0]["labels"] == {"team": "ml", "severity": "warning", "source": "kv_blocks"}
    spike = next(a for a in alerts if a["alert"] == "PreemptionSpike")
    assert "> 0.5 unless" in spike["expr"]
    stall = next(a for a in alerts if a["alert"] == "EngineStalled")
    assert "[90s]" in stall["expr"] and stall["labels"]["severity"] == "warning"
    recording = yaml.safe_load(build_rules(config).rules_file())["groups"][0]["rules"]
    short, baseline = recording[0]["expr"], recording[1]["expr"]
    assert "[60s]" in short
    assert "[840s] offset 60s" in baseline  # the baseline ends where the short window starts


def test_runbooks_become_annotations() -> None:
    alerts = _alerts(
        yaml.safe_load(build_rules(RulesConfig(), runbooks=runbooks()).rules_file())["groups"]
    )
    for alert in alerts:
        if alert["alert"] in ENGINE_ALERTS:
            assert alert["annotations"]["runbook"], alert


def _unit_test_folder(tmp_path: Path, config: RulesConfig) -> Path:
    # Annotations are templates checked by `promtool check rules`; promtool's unit tests
    # compare them verbatim, so the unit tests run on the conditions and labels alone.
    data = yaml.safe_load(build_rules(config).rules_file())
    for rule in _alerts(data["groups"]):
        rule.pop("annotations", None)
    (tmp_path / "kvpilot.rules.yaml").write_text(yaml.safe_dump(data))
    shutil.copy(HERE / "rules_unit_tests.yaml", tmp_path / "rules_unit_tests.yaml")
    return tmp_path


def test_promtool_unit_tests_fire_and_do_not_fire_each_alert(tmp_path: Path) -> None:
    folder = _unit_test_folder(tmp_path, RulesConfig())
    tested = {
        case["alertname"]
        for group in yaml.safe_load((folder / "rules_unit_tests.yaml").read_text())["tests"]
        for case in group["alert_rule_test"]
    }
    assert tested == ENGINE_ALERTS | SELF_ALERTS
    result = promtool("test", "rules", "rules_unit_tests.yaml", cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("change", "alert"),
    [
        ({"fragmentation": {"kv_blocks": {"threshold_ratio": 0.6}}}, "KvFragmentationHigh"),
        ({"preemption_spike": {"baseline_multiple": 100}}, "PreemptionSpike"),
        ({"kv_saturation": {"for_s": 600}}, "KvCacheSaturated"),
        ({"engine_stall": {"stall_s": 300}}, "EngineStalled"),
        ({"gpu_memory_growth": {"min_growth_bytes": 2**40}}, "GpuMemoryGrowth"),
    ],
)
def test_the_unit_tests_fail_when_the_settings_change(
    tmp_path: Path, change: dict, alert: str
) -> None:
    # The same hand-written expectations against other thresholds must fail, and name the alert.
    folder = _unit_test_folder(tmp_path, RulesConfig.model_validate(change))
    result = promtool("test", "rules", "rules_unit_tests.yaml", cwd=folder)
    assert result.returncode != 0
    assert f"alertname: {alert}" in result.stdout + result.stderr


def test_prometheus_rule_manifest_holds_the_same_groups(tmp_path: Path) -> None:
    groups = build_rules(RulesConfig(), runbooks=runbooks())
    manifest = yaml.safe_load(groups.prometheus_rule(namespace="serving"))
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["namespace"] == "serving"
    assert manifest["spec"]["groups"] == yaml.safe_load(groups.rules_file())["groups"]
    path = tmp_path / "groups.yaml"
    path.write_text(yaml.safe_dump({"groups": manifest["spec"]["groups"]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_command_writes_both_forms(tmp_path: Path) -> None:
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    plain = runner.invoke(app, ["rules", "--evaluation-interval", "30"])
    assert plain.exit_code == 0, plain.output
    groups = yaml.safe_load(plain.stdout)["groups"]
    assert {g["name"] for g in groups} == {"kvpilot.recording", "kvpilot.alerts", "kvpilot.self"}
    assert all(g["interval"] == "30s" for g in groups)
    out = tmp_path / "rule.yaml"
    manifest = runner.invoke(
        app, ["rules", "--format", "prometheusrule", "--namespace", "serving", "-o", str(out)]
    )
    assert manifest.exit_code == 0, manifest.output
    document = yaml.safe_load(out.read_text())
    assert document["kind"] == "PrometheusRule"
    assert document["metadata"]["namespace"] == "serving"
    assert all("interval" not in g for g in document["spec"]["groups"])
