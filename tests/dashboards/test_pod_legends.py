"""Replicas of one model draw distinct lines: the pod leads every per-pod legend."""

from __future__ import annotations

import pytest

from kvpilot.dashboards.build import build_dashboards
from kvpilot.dashboards.panels import Query, pod_legend


@pytest.mark.parametrize(
    ("expr", "legend", "shown"),
    [
        ('kvpilot_kv_usage_ratio{job=~"$job"}', "{{model_name}}", "{{pod}} {{model_name}}"),
        ("sum by (model_name) (rate(x[5m]))", "{{model_name}}", "{{model_name}}"),
        ("sum by (pod, model_name) (rate(x[5m]))", "{{model_name}}", "{{pod}} {{model_name}}"),
        ("sum without (pod) (x)", "{{model_name}}", "{{model_name}}"),
        ("sum(rate(x[5m]))", "all", "all"),
        ("x", "{{pod}} {{engine}}", "{{pod}} {{engine}}"),
    ],
)
def test_the_pod_leads_a_legend_only_where_the_series_keep_it(
    expr: str, legend: str, shown: str
) -> None:
    assert pod_legend(Query(expr, legend)) == shown


def test_every_per_engine_timeseries_legend_names_the_pod() -> None:
    missing, seen = [], 0
    for dashboard in build_dashboards():
        panels = list(dashboard.model().get("panels", []))
        while panels:
            panel = panels.pop(0)
            panels.extend(panel.get("panels", []))
            if panel.get("type") != "timeseries":
                continue
            for target in panel.get("targets", []):
                legend, expr = target.get("legendFormat", ""), target.get("expr", "")
                if "{{engine}}" not in legend or " by (" in expr or "sum(" in expr:
                    continue
                seen += 1
                if "{{pod}}" not in legend:
                    missing.append((dashboard.uid, panel.get("title"), legend))
    assert seen >= 8
    assert not missing, missing
