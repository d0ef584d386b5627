"""The generated Prometheus rules: promtool accepts them, and they fire when they should."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from exported_series import Series, in_kubernetes, kvpilot_series, pick
from prometheus_server import PROMTOOL
from rule_cases import alert_cases
from typer.testing import CliRunner

from kvpilot.agent.cli.dashboards_cmd import register, runbooks
from kvpilot.agent.rules import fragmentation
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.dashboards.rule_context import (
    RUNBOOK_PATH,
    RUNBOOK_URL_BASE,
    SCRAPE_INTERVAL_S,
    duration,
)
from kvpilot.dashboards.rules import build_rules

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ALERTS = {
    "VllmKvFragmentationHigh",
    "VllmPreemptionSpike",
    "VllmKvCacheSaturated",
    "VllmEngineStalled",
    "VllmKvTokenOccupancyLow",
    "VllmRequestsDeferred",
    "VllmGpuMemoryGrowth",
}
SELF_ALERTS = {
    "KvpilotAbsent",
    "KvpilotDown",
    "KvpilotCollectorDown",
    "KvpilotOutboxBacklog",
    "KvpilotRemediationCircuitOpen",
    "KvpilotStateWriteErrors",
    "KvpilotNotificationsGivenUp",
    "KvpilotBackgroundTaskFailed",
    "KvpilotTickOverruns",
    "KvpilotConfigReloadFailed",
    "KvpilotUnattendedCanary",
}
SCRAPE_INTERVALS_S = (15.0, 30.0)
_RANGE = re.compile(r"\[(\d+)s\]")


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


def _alerts(groups: list[dict]) -> list[dict]:
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


@pytest.mark.parametrize("scrape_s", SCRAPE_INTERVALS_S)
def test_promtool_check_rules_accepts_the_generated_rules(tmp_path: Path, scrape_s: float) -> None:
    path = tmp_path / "kvpilot.rules.yaml"
    rules = build_rules(RulesConfig(), runbooks=runbooks(), scrape_interval_s=scrape_s)
    path.write_text(rules.rules_file())
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 32 rules found" in result.stdout


def test_the_default_scrape_interval_is_the_shipped_service_monitors() -> None:
    monitor = yaml.safe_load((ROOT / "deploy/base/servicemonitor.yaml").read_text())
    intervals = {endpoint["interval"] for endpoint in monitor["spec"]["endpoints"]}
    assert intervals == {duration(SCRAPE_INTERVAL_S)}


@pytest.mark.parametrize("scrape_s", SCRAPE_INTERVALS_S)
def test_windows_hold_four_scrapes_and_no_alert_fires_on_one(scrape_s: float) -> None:
    groups = yaml.safe_load(build_rules(RulesConfig(), scrape_interval_s=scrape_s).rules_file())[
        "groups"
    ]
    rules = [rule for group in groups for rule in group["rules"]]
    ranges = [int(r) for rule in rules for r in _RANGE.findall(rule["expr"])]
    assert ranges and min(ranges) >= 4 * scrape_s
    for alert in _alerts(groups):
        assert int(alert["for"].removesuffix("s")) >= 2 * scrape_s, alert


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
    frag = [a for a in alerts if a["alert"] == "VllmKvFragmentationHigh"]
    assert len(frag) == 1  # the allocator rule is disabled
    assert frag[0]["expr"] == 'kvpilot_fragmentation_ratio{source="kv_blocks"} > 0.45'
    assert frag[0]["for"] == "30s"
    assert frag[0]["labels"] == {"team": "ml", "severity": "warning", "source": "kv_blocks"}
    spike = next(a for a in alerts if a["alert"] == "VllmPreemptionSpike")
    assert "> 0.5 unless" in spike["expr"]
    stall = next(a for a in alerts if a["alert"] == "VllmEngineStalled")
    assert "[90s]" in stall["expr"] and stall["labels"]["severity"] == "warning"
    recording = yaml.safe_load(build_rules(config).rules_file())["groups"][0]["rules"]
    short, baseline = recording[0]["expr"], recording[1]["expr"]
    assert "[60s]" in short
    assert "[840s] offset 60s" in baseline  # the baseline ends where the short window starts


def test_every_alert_has_a_summary_a_description_and_a_runbook_url() -> None:
    alerts = _alerts(
        yaml.safe_load(build_rules(RulesConfig(), runbooks=runbooks()).rules_file())["groups"]
    )
    for alert in alerts:
        annotations = alert["annotations"]
        assert annotations["summary"] and annotations["description"], alert
        assert annotations["runbook_url"] == f"{RUNBOOK_URL_BASE}{alert['alert']}.md"
        # Absolute, at this version's tag, and the page is in the repository.
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        prefix = f"https://github.com/kvpilot/kvpilot/blob/v{version}/"
        assert annotations["runbook_url"].startswith(prefix)
        assert (ROOT / annotations["runbook_url"].removeprefix(prefix)).is_file()
    spike = next(a for a in alerts if a["alert"] == "VllmPreemptionSpike")
    assert spike["annotations"]["description"] == runbooks()["VllmPreemptionSpike"]
    for alert in (a for a in alerts if a["alert"] == "VllmKvFragmentationHigh"):
        source = alert["labels"]["source"]  # each source's rule says what its pool means
        assert alert["annotations"]["description"] == fragmentation.RUNBOOKS[source]


def test_every_alert_has_a_runbook_page_that_answers_the_four_questions() -> None:
    pages = {path.stem: path for path in (ROOT / RUNBOOK_PATH).glob("*.md")}
    assert set(pages) == ENGINE_ALERTS | SELF_ALERTS
    listed = (ROOT / "docs" / "alerts.md").read_text()
    for name in pages:
        assert f"| `{name}` |" in listed and f"(runbooks/{name}.md)" in listed, name
    for name, path in pages.items():
        text = path.read_text()
        assert text.startswith(f"# {name}\n"), path
        for section in ("**Means.**", "**Confirm.**", "**What kvpilot did.**", "**Next.**"):
            assert section in text, (path, section)


def _unit_test_folder(tmp_path: Path, config: RulesConfig, scrape_s: float) -> Path:
    # Annotations are templates checked by `promtool check rules`; promtool's unit tests
    # compare them verbatim, so the unit tests run on the conditions and labels alone.
    data = yaml.safe_load(build_rules(config, scrape_interval_s=scrape_s).rules_file())
    for rule in _alerts(data["groups"]):
        rule.pop("annotations", None)
    (tmp_path / "kvpilot.rules.yaml").write_text(yaml.safe_dump(data))
    # The expectations follow the product's defaults whatever `config` the rules came from.
    cases = alert_cases(RulesConfig(), scrape_s)
    (tmp_path / "rules_unit_tests.yaml").write_text(yaml.safe_dump(cases))
    return tmp_path


@pytest.mark.parametrize("scrape_s", SCRAPE_INTERVALS_S)
def test_promtool_unit_tests_fire_and_do_not_fire_each_alert(
    tmp_path: Path, scrape_s: float
) -> None:
    folder = _unit_test_folder(tmp_path, RulesConfig(), scrape_s)
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
        ({"fragmentation": {"kv_blocks": {"threshold_ratio": 0.6}}}, "VllmKvFragmentationHigh"),
        ({"preemption_spike": {"baseline_multiple": 100}}, "VllmPreemptionSpike"),
        ({"kv_saturation": {"for_s": 600}}, "VllmKvCacheSaturated"),
        ({"engine_stall": {"stall_s": 300}}, "VllmEngineStalled"),
        ({"gpu_memory_growth": {"min_growth_bytes": 2**40}}, "VllmGpuMemoryGrowth"),
    ],
)
def test_the_unit_tests_fail_when_the_settings_change(
    tmp_path: Path, change: dict, alert: str
) -> None:
    # The default settings' expectations against other thresholds must fail, and name the alert.
    folder = _unit_test_folder(tmp_path, RulesConfig.model_validate(change), SCRAPE_INTERVAL_S)
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
    plain = runner.invoke(app, ["rules", "--evaluation-interval", "30", "--scrape-interval", "60"])
    assert plain.exit_code == 0, plain.output
    groups = yaml.safe_load(plain.stdout)["groups"]
    names = {g["name"] for g in groups}
    assert names == {"kvpilot.recording", "kvpilot.aggregates", "kvpilot.alerts", "kvpilot.self"}
    assert all(g["interval"] == "30s" for g in groups)
    stall = next(a for a in _alerts(groups) if a["alert"] == "VllmEngineStalled")
    assert "[240s]" in stall["expr"] and stall["for"] == "120s"  # four and two scrapes
    out = tmp_path / "rule.yaml"
    manifest = runner.invoke(
        app, ["rules", "--format", "prometheusrule", "--namespace", "serving", "-o", str(out)]
    )
    assert manifest.exit_code == 0, manifest.output
    document = yaml.safe_load(out.read_text())
    assert document["kind"] == "PrometheusRule"
    assert document["metadata"]["namespace"] == "serving"
    assert all("interval" not in g for g in document["spec"]["groups"])


def _pod(host: str, namespace: str) -> tuple[Series, ...]:
    """kvpilot's series of one sidecar pod in `namespace`, as kube-prometheus-stack stores them."""
    series = in_kubernetes(kvpilot_series(host), pod=f"vllm-{host}", container="kvpilot")
    return tuple(Series(s.name, _relabel(s.labels, namespace=namespace)) for s in series)


def _relabel(labels: tuple[tuple[str, str], ...], **change: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({**dict(labels), **change}.items()))


def test_per_model_and_per_namespace_recording_rules_add_the_replicas_up(tmp_path: Path) -> None:
    """Two replicas of a model in `serving` and one in `batch`, fed through promtool."""
    scrapes = 20  # 15 s apart: past the preemption rate's window
    feeds = {"a": ("serving", 0.5, 3), "b": ("serving", 0.9, 4), "c": ("batch", 0.2, 1)}
    inputs = []
    for host, (namespace, usage, running) in feeds.items():
        series = _pod(host, namespace)
        for name, value in (
            ("kvpilot_kv_usage_ratio", usage),
            ("kvpilot_requests_running", running),
        ):
            inputs.append({"series": pick(series, name).promtool(), "values": f"{value}x{scrapes}"})
        # One kvpool preemption a second on every replica.
        preemptions = pick(series, "kvpilot_preemptions_total", counter="kvpool")
        inputs.append({"series": preemptions.promtool(), "values": f"0+15x{scrapes}"})
        firing = pick(series, "kvpilot_alerts", state="firing")
        inputs.append({"series": firing.promtool(), "values": f"1x{scrapes}"})
    model = pick(_pod("a", "serving"), "kvpilot_kv_usage_ratio").label("model_name")

    def expect(expr: str, *samples: tuple[dict[str, str], float]) -> dict[str, Any]:
        return {
            "expr": expr,
            "eval_time": "4m",
            "exp_samples": [{"labels": expr + labels_text(ls), "value": v} for ls, v in samples],
        }

    def labels_text(labels: dict[str, str]) -> str:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"

    serving = {"model_name": model, "namespace": "serving"}
    batch = {"model_name": model, "namespace": "batch"}
    per_model = "namespace_model_name"
    cases = [
        expect(f"{per_model}:kvpilot_kv_usage_ratio:max", (serving, 0.9), (batch, 0.2)),
        expect(f"{per_model}:kvpilot_kv_usage_ratio:avg", (serving, 0.7), (batch, 0.2)),
        expect(f"{per_model}:kvpilot_requests_running:sum", (serving, 7), (batch, 1)),
        expect(f"{per_model}:kvpilot_preemption_rate_per_second:sum", (serving, 2), (batch, 1)),
        expect(
            "namespace:kvpilot_requests_running:sum",
            ({"namespace": "serving"}, 7),
            ({"namespace": "batch"}, 1),
        ),
        expect(
            "namespace:kvpilot_alerts_firing:sum",
            ({"namespace": "serving"}, 2),
            ({"namespace": "batch"}, 1),
        ),
    ]
    (tmp_path / "kvpilot.rules.yaml").write_text(build_rules(RulesConfig()).rules_file())
    tests = {
        "rule_files": ["kvpilot.rules.yaml"],
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": inputs, "promql_expr_test": cases}],
    }
    (tmp_path / "aggregates_test.yaml").write_text(yaml.safe_dump(tests))
    result = promtool("test", "rules", "aggregates_test.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
