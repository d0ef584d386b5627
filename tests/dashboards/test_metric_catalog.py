"""The metric catalog is the single source of names: the README, the exposition, the tuning
families and promtool agree with it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from typer.testing import CliRunner

from kvpilot.agent.app.exposition import build_registry, tuning_families
from kvpilot.agent.cli.main import app
from kvpilot.dashboards import tuning_metrics
from kvpilot.dashboards.metric_catalog import (
    CATALOG,
    SPECS,
    FamilySpec,
    markdown_table,
    replace_table,
    specs,
)

README = Path(__file__).resolve().parents[2] / "README.md"
TUNING_NAMES = {
    tuning_metrics.TRIAL_GOODPUT,
    tuning_metrics.TRIAL_PREEMPTION_RATE,
    tuning_metrics.TRIAL_INFO,
    tuning_metrics.BEST_GOODPUT,
    tuning_metrics.TRIALS_TOTAL,
    tuning_metrics.LIVE_FLAGS_INFO,
    tuning_metrics.CANARY_METRIC,
}


def test_readme_table_is_generated_from_the_catalog() -> None:
    text = README.read_text()
    match = re.search(r"<!-- metric-table:start -->\n(.*?)\n<!-- metric-table:end -->", text, re.S)
    assert match, "README lacks the metric-table markers"
    assert match.group(1) == markdown_table(), "run `kvpilot metrics-table --readme README.md`"


def test_the_command_rewrites_only_the_table(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- metric-table:start -->\nold\n<!-- metric-table:end -->\nend\n")
    result = CliRunner().invoke(app, ["metrics-table", "--readme", str(readme)])
    assert result.exit_code == 0, result.output
    text = readme.read_text()
    assert text.startswith("intro\n<!-- metric-table:start -->\n| metric |")
    assert text.endswith("<!-- metric-table:end -->\nend\n") and "\nold\n" not in text
    assert replace_table(text) == text


def test_the_tuning_families_are_in_the_one_catalog_and_the_readme() -> None:
    assert set(CATALOG) >= TUNING_NAMES
    assert specs(*(spec.name for spec in tuning_metrics.SPECS)) == tuning_metrics.SPECS
    assert all(CATALOG[spec.name] is spec for spec in tuning_metrics.SPECS)
    table = markdown_table()
    for name in TUNING_NAMES:
        assert f"| `{name}` |" in table


def test_every_family_the_exposition_writes_is_in_the_catalog() -> None:
    live = tuning_metrics.LiveFlags("vllm", "--max-num-seqs 8", tuning_metrics.FlagSource.PROMOTED)
    families = tuning_metrics.tuning_families([], [live])
    text = generate_latest(build_registry(lambda: (), tuning_families(families))).decode()
    by_name = {name: spec for spec in SPECS for name in (spec.name, spec.base_name)}
    exported = re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M)
    assert {name for name, _ in exported} >= {"kvpilot_build_info", "kvpilot_tuning_trials_total"}
    for name, kind in exported:
        spec = by_name[name]
        assert kind == ("gauge" if spec.kind == "info" else spec.kind), name


def test_names_follow_prometheus_conventions() -> None:
    assert len(CATALOG) == len(SPECS)
    for name, spec in CATALOG.items():
        assert name.startswith("kvpilot_"), name
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", name), name
        if spec.kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
        if spec.kind == "info":
            assert name.endswith("_info"), name
        assert spec.help.endswith("."), name
        assert len(set(spec.labels)) == len(spec.labels), name


GOOD = FamilySpec("kvpilot_things_total", "counter", ("server",), "Things counted.")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"name": "vllm_things_total"}, "kvpilot_"),
        ({"name": "kvpilot_Things_total"}, "lower-case"),
        ({"kind": "gauge"}, "_total"),
        ({"name": "kvpilot_things"}, "_total"),
        ({"kind": "info", "name": "kvpilot_things"}, "_info"),
        ({"labels": ("server", "server")}, "repeated"),
        ({"help": "Things counted"}, "full stop"),
    ],
)
def test_a_spec_that_breaks_the_conventions_is_refused(change: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        dataclasses.replace(GOOD, **change)


def test_base_names_drop_the_suffix_the_kind_adds() -> None:
    assert CATALOG["kvpilot_ticks_total"].base_name == "kvpilot_ticks"
    assert CATALOG["kvpilot_build_info"].base_name == "kvpilot_build"
    assert CATALOG["kvpilot_outbox_backlog"].base_name == "kvpilot_outbox_backlog"


def test_a_name_outside_the_catalog_is_refused() -> None:
    with pytest.raises(KeyError, match="kvpilot_nowhere"):
        specs(tuning_metrics.TRIAL_GOODPUT, "kvpilot_nowhere")
    with pytest.raises(TypeError):
        CATALOG["kvpilot_nowhere"] = GOOD  # type: ignore[index]
