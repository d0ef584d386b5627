"""The dashboards fit a fleet: scope variables every query filters by, a stat row on top,
events marked on the time axis, and units that say what each query measures."""

from __future__ import annotations

import re
from typing import Any

import pytest
from dashboard_queries import annotation_queries, panel_queries, variable_queries

from kvpilot.dashboards.build import build_dashboards
from kvpilot.dashboards.memory import UID as MEMORY_UID

SCOPE = ("cluster", "namespace", "pod")
# A selector: a metric name and its matchers.
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")


def _models() -> dict[str, dict[str, Any]]:
    return {d.uid: d.model() for d in build_dashboards()}


def _panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in model["panels"] if p["type"] != "row"]


@pytest.mark.parametrize("uid", sorted(_models()))
def test_every_dashboard_has_the_scope_variables_in_order(uid: str) -> None:
    names = [v["name"] for v in _models()[uid]["templating"]["list"]]
    assert names[1:6] == ["cluster", "namespace", "job", "pod", "instance"]
    queries = variable_queries(_models()[uid])
    # Each narrows by the ones before it: pods of the chosen workloads of the chosen
    # namespaces of the chosen clusters.
    pod = next(q for q in queries if q.endswith(", pod)"))
    assert all(f'{label}=~"${label}"' in pod for label in ("cluster", "namespace", "job"))
    for variable in _models()[uid]["templating"]["list"]:
        if variable["name"] in (*SCOPE, "job"):
            # 'All' is `.*`, which also matches a series without the label (one Prometheus).
            assert variable["includeAll"] and variable["allValue"] == ".*"


@pytest.mark.parametrize("uid", sorted(_models()))
def test_every_query_filters_by_cluster_namespace_and_pod(uid: str) -> None:
    model = _models()[uid]
    unscoped = []
    for query in (*panel_queries(model), *annotation_queries(model)):
        for name, matchers in _SELECTOR.findall(query.expr):
            if not all(f'{label}=~"${label}"' in matchers for label in SCOPE):
                unscoped.append((query.panel, name))
    assert not unscoped, unscoped


def test_the_memory_dashboard_opens_on_a_stat_row() -> None:
    panels = _models()[MEMORY_UID]["panels"]
    assert panels[0]["type"] == "row"
    stats = []
    for panel in panels[1:]:
        if panel["type"] != "stat":
            break
        stats.append(panel["title"])
    assert stats == [
        "KV cache usage",
        "Free KV blocks",
        "Preemptions",
        "Alerts firing",
        "Restarts by kvpilot",
        "vLLM container restarts",
        "Promotions",
        "Live flags",
    ]
    widths = [p["gridPos"]["w"] for p in panels[1 : 1 + len(stats)]]
    assert sum(widths) == 24  # one row
    flags = next(p for p in panels if p["title"] == "Live flags")
    assert flags["options"]["textMode"] == "name"  # the flags are the legend, not the 1
    assert "{{flags}}" in flags["targets"][0]["legendFormat"]
    in_range = [p for p in panels if p["title"] in ("Restarts by kvpilot", "Promotions")]
    assert all("$__range" in p["targets"][0]["expr"] for p in in_range)


@pytest.mark.parametrize("uid", sorted(_models()))
def test_events_are_marked_beside_alerts_and_remediations(uid: str) -> None:
    names = [a.panel for a in annotation_queries(_models()[uid])]
    assert names == [
        "kvpilot alerts",
        "kvpilot remediations",
        "kvpilot promotions",
        "kvpilot trials",
        "vLLM container restarts",
    ]
    restarts = annotation_queries(_models()[uid])[-1].expr
    assert "kube_pod_container_status_restarts_total" in restarts
    assert 'container=~"$container"' in restarts


def _expected_unit(expr: str) -> str:
    """The unit a query's values are in, from what it reads and how."""
    name = _SELECTOR.search(expr).group(1)  # type: ignore[union-attr]
    if name == "kvpilot_canary_metric":  # in the unit of the judged metric it names
        name = re.search(r'metric="([a-z0-9_]+)"', expr).group(1)  # type: ignore[union-attr]
    if "histogram_quantile" in expr:
        return "s" if name.endswith("_seconds_bucket") else "short"
    if "$__range" in expr or name.endswith(("_info", "ALERTS")) or name == "ALERTS":
        return "short"  # counts over the range, and labels shown as text
    if expr.count("rate(") == 2 and " / " in expr:
        return "short"  # a mean: a rate over a rate
    if "rate(" in expr:
        return "suffix: tok/s" if "tokens" in name else "suffix: /s"
    for suffixes, unit in (
        (("_tokens_per_second", "_tokens_per_s"), "suffix: tok/s"),
        (("_per_second", "_per_s"), "suffix: /s"),
        (("_bytes",), "bytes"),
        (("_ratio", "_perc"), "percentunit"),
        (("_seconds", "_s"), "s"),
    ):
        if name.endswith(suffixes):
            return unit
    return "short"


@pytest.mark.parametrize("uid", sorted(_models()))
def test_every_panel_has_the_unit_of_what_it_measures(uid: str) -> None:
    wrong = []
    for panel in _panels(_models()[uid]):
        if panel["type"] == "table":
            continue
        unit = panel["fieldConfig"]["defaults"]["unit"]
        for target in panel["targets"]:
            expected = _expected_unit(target["expr"])
            if unit != expected:
                wrong.append((panel["title"], target["refId"], unit, expected))
    assert not wrong, wrong


def test_rates_are_per_second_and_goodput_in_tokens_per_second() -> None:
    # The two the dashboards had wrong: "ops" and a bare number.
    panels = {p["title"]: p for m in _models().values() for p in _panels(m) if "fieldConfig" in p}
    unit = {title: p["fieldConfig"]["defaults"]["unit"] for title, p in panels.items()}
    assert unit["Trial goodput"] == "suffix: tok/s"
    assert unit["Canary against baseline: goodput_tokens_per_s"] == "suffix: tok/s"
    assert unit["Preemption rate"] == unit["Trial preemption rate"] == "suffix: /s"
    # The judge counts preemptions per finished request: a number, not a rate.
    assert unit["Canary against baseline: preemptions_per_request"] == "short"


@pytest.mark.parametrize("uid", sorted(_models()))
def test_every_query_of_kvpilots_series_filters_by_the_workload(uid: str) -> None:
    """The `job` variable picks a workload: every kvpilot_* selector matches on it (vLLM's
    own series come from another job, narrowed through the pods)."""
    model = _models()[uid]
    unfiltered = []
    for query in (*panel_queries(model), *annotation_queries(model)):
        for name, matchers in _SELECTOR.findall(query.expr):
            if name.startswith("kvpilot_") and 'job=~"$job"' not in matchers:
                unfiltered.append((query.panel, name))
    assert not unfiltered, unfiltered
