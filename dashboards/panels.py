"""Shared builders for kvpilot's dashboards: the datasource, template variables, panels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)

# The Grafana version the foundation SDK's models were generated for (see pyproject's pin).
GRAFANA_VERSION = "11.6"
DATASOURCE_VARIABLE = "datasource"
DATASOURCE = DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VARIABLE}}}")
# Every kvpilot selector narrows by the instance variable; the engine ones also by model
# and engine, the GPU ones by GPU.
INSTANCE = 'instance=~"$instance"'
ENGINE = 'instance=~"$instance", model_name=~"$model", engine=~"$engine"'
GPU = 'instance=~"$instance", gpu=~"$gpu"'
# vLLM's own series come from vLLM's target, whose instance differs from the agent's.
VLLM_ENGINE = 'model_name=~"$model", engine=~"$engine"'


# A dashboard is a sequence of rows and panels, in layout order.
Item = dashboard_builders.Row | timeseries.Panel


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
            .legend_format(query.legend)
            .ref_id(chr(ord("A") + index))
            .datasource(DATASOURCE)
        )
    return panel
