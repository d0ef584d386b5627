"""Reads every PromQL query out of a dashboard's JSON model, and fills in its variables."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PanelQuery:
    """One query of a panel (or of an annotation, with `panel` naming the annotation)."""

    panel: str
    ref_id: str
    expr: str


def panel_queries(model: dict[str, Any]) -> list[PanelQuery]:
    """Every panel target, rows' nested panels included."""
    out = []
    panels = list(model.get("panels", []))
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []) or []:
            out.append(PanelQuery(panel["title"], target["refId"], target["expr"]))
    return out


def annotation_queries(model: dict[str, Any]) -> list[PanelQuery]:
    """Every annotation's query."""
    return [
        PanelQuery(a["name"], "annotation", a["expr"])
        for a in model.get("annotations", {}).get("list", [])
        if a.get("expr")
    ]


def variable_queries(model: dict[str, Any]) -> list[str]:
    """Every query variable's `label_values(...)` query."""
    return [v["query"] for v in model["templating"]["list"] if v["type"] == "query"]


# The dashboards' variables (every one a regex, 'All' being `.*`).
VARIABLES = (
    "cluster",
    "namespace",
    "job",
    "pod",
    "instance",
    "container",
    "model",
    "engine",
    "gpu",
    "server",
)


def fill(expr: str, *, rate_interval: str = "15s", time_range: str = "1h") -> str:
    """The query as Grafana sends it with every variable on 'All' (`.*`)."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__range", time_range)
    return re.sub(rf"\$({'|'.join(VARIABLES)})\b", ".*", expr)


_NOT_NAMES = {
    "sum",
    "by",
    "rate",
    "increase",
    "histogram_quantile",
    "and",
    "or",
    "unless",
    "on",
    "without",
    "max",
    "min",
    "avg",
    "offset",
    "deriv",
    "delta",
    "changes",
    "absent",
    "min_over_time",
    "max_over_time",
    "label_values",
    "bool",
    "ignoring",
    "group_left",
    "instance",
    "gpu",
    "role",
    "le",
    "model_name",
    "engine",
    "job",
    "source",
    "counter",
    "cluster",
    "namespace",
    "pod",
    "outcome",
    "reason",
    "count",
    "count_over_time",
    "vector",
    "__range",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers and strings removed)."""
    stripped = re.sub(r'"[^"]*"', '""', expr)
    stripped = re.sub(r"\{[^}]*\}", " ", stripped)
    stripped = re.sub(r"\[[^\]]*\]", " ", stripped)
    stripped = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)?[smhdwy]?\b", " ", stripped)
    stripped = re.sub(r"\bby\s*\([^)]*\)|\bon\s*\([^)]*\)|\bwithout\s*\([^)]*\)", " ", stripped)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", stripped))
    return names - _NOT_NAMES
