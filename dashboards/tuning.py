"""The *kvpilot / Tuning* dashboard: trials, the live stable flags, canary against baseline."""

from __future__ import annotations

from collections.abc import Sequence

from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, table
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    Dashboard,
    DashboardCursorSync,
    DataTransformerConfig,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from kvpilot.dashboards.annotations import annotation_queries
from kvpilot.dashboards.panels import (
    COUNT,
    DATASOURCE,
    INSTANCE,
    PER_SECOND,
    RATIO,
    SECONDS,
    TOKENS_PER_SECOND,
    Item,
    Query,
    datasource_variable,
    query_variable,
    scope_variables,
    timeseries_panel,
)
from kvpilot.dashboards.tuning_metrics import (
    BEST_GOODPUT,
    CANARY_METRIC,
    LIVE_FLAGS_INFO,
    TRIAL_GOODPUT,
    TRIAL_INFO,
    TRIAL_PREEMPTION_RATE,
    TRIALS_TOTAL,
)
from kvpilot.tuner.judge.judgement import DEFAULT_METRICS

UID = "kvpilot-tuning"
TITLE = "kvpilot / Tuning"
SERVER = f'{INSTANCE}, server=~"$server"'
# Labels Prometheus adds or the table does not need.
_HIDDEN_COLUMNS = ("Time", "Value", "__name__", "job", "instance")


def _table_panel(
    title: str, description: str, expr: str, columns: Sequence[str], *, height: int = 8
) -> table.Panel:
    """An instant query as a table: one row per series, its labels as `columns`."""
    hidden = {name: True for name in _HIDDEN_COLUMNS}
    order = {name: index for index, name in enumerate(columns)}
    return (
        table.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(24)
        .height(height)
        .with_target(
            prometheus.Dataquery()
            .expr(expr)
            .instant()
            .format(PromQueryFormat.TABLE)
            .ref_id("A")
            .datasource(DATASOURCE)
        )
        .with_transformation(
            DataTransformerConfig(
                id_val="organize", options={"excludeByName": hidden, "indexByName": order}
            )
        )
    )


def _trials_row() -> list[Item]:
    goodput = (
        timeseries_panel(
            "Trial goodput",
            "Each finished trial's goodput under the SLO (kept for infeasible trials), with "
            "its flags, state and canary verdict; the line is the best feasible goodput so far.",
            [
                Query(
                    f"{TRIAL_GOODPUT}{{{INSTANCE}}} "
                    f"* on (instance, trial) group_left (flags) {TRIAL_INFO}{{{INSTANCE}}}",
                    "#{{trial}} {{flags}} ({{state}}, {{verdict}})",
                ),
                Query(f"{BEST_GOODPUT}{{{INSTANCE}}}", "best ({{instance}})"),
            ],
            unit=TOKENS_PER_SECOND,
            width=24,
            height=9,
        )
        .show_points(common.VisibilityMode.ALWAYS)
        .point_size(6)
    )
    return [
        dashboard_builders.Row("Trials"),
        goodput,
        timeseries_panel(
            "Trial preemption rate",
            "Preemptions per second over each finished trial's measurement window.",
            [Query(f"{TRIAL_PREEMPTION_RATE}{{{INSTANCE}}}", "#{{trial}}")],
            unit=PER_SECOND,
        ),
        timeseries_panel(
            "Trials by final state",
            "Trials finished: complete, infeasible (the candidate's fault), failed (the "
            "tuner's or runtime's), aborted (interrupted).",
            [Query(f"sum by (state) ({TRIALS_TOTAL}{{{INSTANCE}}})", "{{state}}")],
            unit=COUNT,
        ),
        _table_panel(
            "Trials",
            "Every trial: its flags, state, canary verdict and the reason it was infeasible, "
            "failed or aborted.",
            f"{TRIAL_INFO}{{{INSTANCE}}}",
            ("trial", "flags", "state", "verdict", "reason"),
            height=10,
        ),
    ]


def _live_flags_row() -> list[Item]:
    return [
        dashboard_builders.Row("Live flags"),
        _table_panel(
            "Live stable flags",
            "The flags each stable server runs with now: as configured, or promoted by the "
            "tuner after a passing canary.",
            f"{LIVE_FLAGS_INFO}{{{SERVER}}}",
            ("server", "flags", "source"),
            height=5,
        ),
    ]


def _unit(metric: str) -> str:
    if metric.endswith("_tokens_per_s"):
        return TOKENS_PER_SECOND
    if metric.endswith("_per_s"):
        return PER_SECOND
    if metric.endswith("_s"):
        return SECONDS
    if metric.endswith("_ratio"):
        return RATIO
    return COUNT


def _canary_row() -> list[Item]:
    panels: list[Item] = [dashboard_builders.Row("Canary against baseline")]
    for spec in DEFAULT_METRICS:
        panels.append(
            timeseries_panel(
                f"Canary against baseline: {spec.name}",
                f"Median of the canary's and the baseline's {spec.name} samples per judged "
                f"trial; "
                + (
                    f"an {spec.direction.value} counts against the canary."
                    if spec.counted
                    else "shown as information, never counted against the canary."
                ),
                [
                    Query(
                        f'{CANARY_METRIC}{{{INSTANCE}, metric="{spec.name}", stat="median"}}',
                        "#{{trial}} {{side}}",
                    )
                ],
                unit=_unit(spec.name),
                width=8,
                height=7,
            ).show_points(common.VisibilityMode.ALWAYS)
        )
    return panels


def tuning_dashboard() -> Dashboard:
    """The Tuning dashboard."""
    builder = (
        dashboard_builders.Dashboard(TITLE)
        .uid(UID)
        .description("kvpilot's tuner: trials, the live stable flags and canary judgements.")
        .tags(["kvpilot", "vllm", "tuning"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .with_variable(datasource_variable())
    )
    for variable in scope_variables(TRIALS_TOTAL):
        builder = builder.with_variable(variable)
    builder = builder.with_variable(
        query_variable("server", "Server", f"label_values({LIVE_FLAGS_INFO}{{{INSTANCE}}}, server)")
    )
    for annotation in annotation_queries():
        builder = builder.annotation(annotation)
    rows = _trials_row() + _live_flags_row() + _canary_row()
    # Grafana keys panels by id: give each a stable one in layout order.
    for panel_id, item in enumerate(rows, start=1):
        if isinstance(item, dashboard_builders.Row):
            builder = builder.with_row(item.id(panel_id))
        else:
            builder = builder.with_panel(item.id(panel_id))
    return builder.build()
