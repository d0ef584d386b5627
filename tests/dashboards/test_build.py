"""Committed dashboards and generated manifests equal a fresh build and read only real names."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import typer
import yaml
from dashboard_queries import annotation_queries, metric_names, panel_queries, variable_queries
from typer.testing import CliRunner

from kvpilot.agent.cli.dashboards_cmd import register, runbooks
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.dashboards.build import build_dashboards, generated_files, stale
from kvpilot.dashboards.memory import ALLOCATOR_PANELS
from kvpilot.dashboards.metric_catalog import CATALOG
from kvpilot.dashboards.rules import build_rules
from kvpilot.dashboards.tuning import UID as TUNING_UID
from kvpilot.dashboards.tuning_metrics import SPECS as TUNING_SPECS
from kvpilot.tuner.judge.judgement import DEFAULT_METRICS

ROOT = Path(__file__).resolve().parents[2]
# vLLM 0.32's own families the dashboards and rules read (checked against vLLM's source below).
VLLM_NAMES = {
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:iteration_tokens_total_count",
    "vllm:num_requests_waiting_by_reason",
    "vllm:request_num_preemptions_bucket",
    "vllm:request_num_preemptions_sum",
    "vllm:request_num_preemptions_count",
    "vllm:kv_block_lifetime_seconds_bucket",
    "vllm:kv_block_idle_before_evict_seconds_bucket",
    "vllm:engine_sleep_state",
    "vllm:simple_kv_offload_load_blocks_total",
    "vllm:simple_kv_offload_save_outcomes_total",
}
# Series of a named external source: kube-state-metrics (tests/fixtures/kube_state_metrics).
EXTERNAL_NAMES = {"kube_pod_container_status_restarts_total"}
# Prometheus's own series, and the rules' recorded ones.
PROMETHEUS_NAMES = {"ALERTS", "up"}
RECORDED = {
    "kvpilot:preemption_rate_per_second:short",
    "kvpilot:preemption_rate_per_second:baseline",
    "kvpilot:gpu_server_memory_bytes",
}


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def _files() -> tuple:
    return generated_files(build_rules(RulesConfig(), runbooks=runbooks()))


def test_committed_files_equal_a_fresh_build() -> None:
    assert stale(ROOT, _files()) == [], "run `kvpilot dashboards build` and commit the result"


def test_build_writes_only_what_changed_and_check_reports_stale(tmp_path: Path) -> None:
    runner = CliRunner()
    first = runner.invoke(_app(), ["dashboards", "build", "--root", str(tmp_path)])
    assert first.exit_code == 0, first.output
    assert first.output.count(": written") == len(_files())
    again = runner.invoke(_app(), ["dashboards", "build", "--root", str(tmp_path)])
    assert again.output.count(": unchanged") == len(_files())
    assert (
        runner.invoke(_app(), ["dashboards", "build", "--root", str(tmp_path), "--check"]).exit_code
        == 0
    )
    memory = tmp_path / "dashboards/json/memory.json"
    memory.write_text(memory.read_text().replace("kvpilot / Memory", "edited"))
    check = runner.invoke(_app(), ["dashboards", "build", "--root", str(tmp_path), "--check"])
    assert check.exit_code == 1
    assert "stale: dashboards/json/memory.json" in check.output


def test_build_takes_the_threshold_from_the_configuration(tmp_path: Path) -> None:
    config = tmp_path / "kvpilot.yaml"
    config.write_text(
        "runtime: {kind: process, port: 8000}\n"
        "rules:\n  fragmentation:\n    kv_blocks:\n      threshold_ratio: 0.4\n"
    )
    result = CliRunner().invoke(
        _app(), ["dashboards", "build", "--root", str(tmp_path), "--config", str(config)]
    )
    assert result.exit_code == 0, result.output
    model = json.loads((tmp_path / "dashboards/json/memory.json").read_text())
    panel = next(p for p in model["panels"] if p["title"] == "Fragmentation rate")
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[-1]["value"] == 0.4
    assert "> 0.4" in (tmp_path / "dashboards/rules/kvpilot.rules.yaml").read_text()


def _memory() -> dict:
    (memory,) = (d for d in build_dashboards() if d.uid == "kvpilot-memory")
    return memory.model()


def test_memory_dashboard_targets_grafana_11_6_and_has_its_variables() -> None:
    model = _memory()
    assert model["schemaVersion"] == 41  # Grafana 11.6's dashboard schema
    names = [v["name"] for v in model["templating"]["list"]]
    assert names == [
        "datasource",
        "cluster",
        "namespace",
        "job",
        "pod",
        "instance",
        "container",
        "model",
        "engine",
        "gpu",
    ]
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    frag = next(p for p in model["panels"] if p["title"] == "Fragmentation rate")
    assert frag["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] == 0.30
    assert frag["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "dashed"
    titles = {p["title"] for p in model["panels"]}
    assert titles >= ALLOCATOR_PANELS


def test_every_name_the_dashboards_and_rules_read_is_exported() -> None:
    model = _memory()
    exprs = [q.expr for q in panel_queries(model) + annotation_queries(model)]
    exprs += variable_queries(model)
    groups = build_rules(RulesConfig()).groups
    exprs += [rule["expr"] for group in groups for rule in group["rules"]]
    read = set().union(*(metric_names(expr) for expr in exprs))
    assert "kvpilot_fragmentation_ratio" in read and "vllm:num_requests_running" in read
    known = set(CATALOG) | VLLM_NAMES | PROMETHEUS_NAMES | RECORDED | EXTERNAL_NAMES
    assert read - known == set()


def test_vllm_names_exist_in_vllm() -> None:
    spec = importlib.util.find_spec("vllm")  # located, not imported: importing vLLM is slow
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent
    source = (root / "v1" / "metrics" / "loggers.py").read_text()
    source += (root / "v1" / "simple_kv_offload" / "metrics.py").read_text()
    for name in VLLM_NAMES:
        family = name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
        assert f'"{family}"' in source, family


def test_file_provisioning_puts_the_dashboards_in_the_kvpilot_folder() -> None:
    provisioning = yaml.safe_load(
        (ROOT / "dashboards/provisioning/kvpilot-dashboards.yaml").read_text()
    )
    assert provisioning["apiVersion"] == 1
    (provider,) = provisioning["providers"]
    assert provider["type"] == "file"
    assert provider["folderUid"] == "kvpilot"  # the folder `dashboards push` uses
    assert provider["options"]["path"].startswith("/")


def _tuning() -> dict:
    (tuning,) = (d for d in build_dashboards() if d.uid == TUNING_UID)
    return tuning.model()


def test_tuning_dashboard_has_its_variables_and_a_canary_panel_per_judged_metric() -> None:
    model = _tuning()
    assert model["schemaVersion"] == 41
    assert [v["name"] for v in model["templating"]["list"]] == [
        "datasource",
        "cluster",
        "namespace",
        "job",
        "pod",
        "instance",
        "container",
        "server",
    ]
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in model["panels"]}
    assert {"Trial goodput", "Trials", "Live stable flags"} <= titles
    assert {f"Canary against baseline: {m.name}" for m in DEFAULT_METRICS} <= titles
    for panel in (p for p in model["panels"] if p["type"] == "table"):
        assert all(t["instant"] and t["format"] == "table" for t in panel["targets"])


def test_every_name_the_tuning_dashboard_reads_is_a_tuning_family() -> None:
    model = _tuning()
    exprs = [q.expr for q in panel_queries(model)] + variable_queries(model)
    labels = {label for spec in TUNING_SPECS for label in spec.labels}
    read = set().union(*(metric_names(expr) for expr in exprs)) - labels
    assert read == {spec.name for spec in TUNING_SPECS}


def test_the_configmap_carries_every_dashboard() -> None:
    (configmap,) = [f for f in _files() if f.path == "deploy/base/grafana-dashboards.yaml"]
    data = yaml.safe_load(configmap.text)["data"]
    assert data == {f"kvpilot-{d.file_name}": d.json_text for d in build_dashboards()}
    assert "kvpilot-tuning.json" in data
