"""Shared builders for kvpilot's dashboards: the datasource, template variables, panels."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableModel,
    VariableRefresh,
    VariableSort,
)

# The Grafana version the foundation SDK's models were generated for (see pyproject's pin).
GRAFANA_VERSION = "11.6"
DATASOURCE_VARIABLE = "datasource"
DATASOURCE = DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VARIABLE}}}")
# Every selector narrows by where the series comes from: the cluster (a label that remote
# storage or federation adds; on a single Prometheus it is absent, and the variable's 'All',
# `.*`, matches a missing label), and the namespace and pod the ServiceMonitor's targets add.
SCOPE = 'cluster=~"$cluster", namespace=~"$namespace", pod=~"$pod"'
# kvpilot's own series also by the workload (the scrape job: a ServiceMonitor's Service or a
# PodMonitor's jobLabel) and its instance; the engine ones by model and engine, the GPU ones
# by GPU. vLLM's and kube-state-metrics' series come from jobs of their own, so the job
# narrows them only through the pods it leaves in the `pod` variable.
INSTANCE = f'{SCOPE}, job=~"$job", instance=~"$instance"'
ENGINE = f'{INSTANCE}, model_name=~"$model", engine=~"$engine"'
GPU = f'{INSTANCE}, gpu=~"$gpu"'
# vLLM's own series come from vLLM's target, whose instance differs from the agent's (its pod
# is the same one when kvpilot runs as the sidecar).
VLLM_ENGINE = f'{SCOPE}, model_name=~"$model", engine=~"$engine"'
# kube-state-metrics' series of the vLLM container: named by the `container` variable.
VLLM_CONTAINER = f'{SCOPE}, container=~"$container"'
DEFAULT_VLLM_CONTAINER = "vllm"  # deploy/base's container name

# Units, by what a query measures: Grafana's built-in ones and custom suffixes for rates that
# are neither operations nor requests.
BYTES = "bytes"
RATIO = "percentunit"
SECONDS = "s"
COUNT = "short"
PER_SECOND = "suffix: /s"  # events per second: preemptions, restored blocks
TOKENS_PER_SECOND = "suffix: tok/s"


# A dashboard is a sequence of rows and panels, in layout order.
Item = dashboard_builders.Row | timeseries.Panel | stat.Panel | table.Panel


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL query of a panel: its expression and legend."""

    expr: str
    legend: str


def datasource_variable() -> dashboard_builders.DatasourceVariable:
    """The Prometheus datasource the dashboard reads."""
    return (
        dashboard_builders.DatasourceVariable(DATASOURCE_VARIABLE)
        .label("Prometheus")
        .type("prometheus")
    )


def query_variable(name: str, label: str, query: str) -> dashboard_builders.QueryVariable:
    """A multi-value variable from label values, with an 'All' that matches everything."""
    return (
        dashboard_builders.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def scope_variables(anchor: str) -> list[cogbuilder.Builder[VariableModel]]:
    """Cluster, namespace, workload (job), pod and instance, each narrowed by the ones before
    it, read from `anchor` (a series every kvpilot exports), and the vLLM container's name."""
    out: list[cogbuilder.Builder[VariableModel]] = []
    narrowed: list[str] = []
    for name, label in (
        ("cluster", "Cluster"),
        ("namespace", "Namespace"),
        ("job", "Workload (job)"),
        ("pod", "Pod"),
        ("instance", "Instance"),
    ):
        selector = f"{anchor}{{{', '.join(narrowed)}}}" if narrowed else anchor
        out.append(query_variable(name, label, f"label_values({selector}, {name})"))
        narrowed.append(f'{name}=~"${name}"')
    out.append(
        dashboard_builders.TextBoxVariable("container")
        .label("vLLM container")
        .description("The vLLM container's name, for kube-state-metrics' restart counts.")
        .default_value(DEFAULT_VLLM_CONTAINER)
    )
    return out


def stat_panel(
    title: str,
    description: str,
    query: Query,
    *,
    unit: str,
    width: int = 3,
    show_name: bool = False,
) -> stat.Panel:
    """A stat of the query's latest value (`show_name`: its legend, for labels as text)."""
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(4)
        .graph_mode(common.BigValueGraphMode.NONE)
        .text_mode(common.BigValueTextMode.NAME if show_name else common.BigValueTextMode.VALUE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
        .with_target(
            prometheus.Dataquery()
            .expr(query.expr)
            .legend_format(query.legend)
            .ref_id("A")
            .datasource(DATASOURCE)
        )
    )


def timeseries_panel(
    title: str,
    description: str,
    queries: Sequence[Query],
    *,
    unit: str,
    width: int = 12,
    height: int = 8,
    min_value: float | None = 0,
    max_value: float | None = None,
    threshold: float | None = None,
) -> timeseries.Panel:
    """A time series panel; `threshold` is drawn as a dashed red line."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
    )
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    if threshold is not None:
        panel = panel.thresholds(
            dashboard_builders.ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps([Threshold(color="green", value=None), Threshold(color="red", value=threshold)])
        ).thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(
                common.GraphThresholdsStyleMode.DASHED
            )
        )
    for index, query in enumerate(queries):
        panel = panel.with_target(
            prometheus.Dataquery()
            .expr(query.expr)
            .legend_format(pod_legend(query))
            .ref_id(chr(ord("A") + index))
            .datasource(DATASOURCE)
        )
    return panel


_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_AGGREGATED = re.compile(r"\b(?:sum|avg|max|min|count|topk|bottomk|quantile)\s*\(")


def pod_legend(query: Query) -> str:
    """The legend led by `{{pod}}` where the series keep their pod label, so that replicas
    of one model draw distinct lines; a series without one (a single Prometheus, no
    Kubernetes) renders the rest of the legend alone. An aggregation that keeps no pod
    (`sum by (model_name)`) keeps its legend."""
    if "{{pod}}" in query.legend:
        return query.legend
    for match in _BY.finditer(query.expr):
        kept = {label.strip() for label in match.group(1).split(",")}
        by = not match.group(0).startswith("without")
        if (by and "pod" not in kept) or (not by and "pod" in kept):
            return query.legend
    if _AGGREGATED.search(query.expr) and not _BY.search(query.expr):
        return query.legend  # aggregated over every label, the pod included
    return f"{{{{pod}}}} {query.legend}"
