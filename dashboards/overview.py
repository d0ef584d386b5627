"""The stat row on top of the Memory dashboard: how the servers in scope stand now, and
what happened to them over the dashboard's time range."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dashboard_builders

from kvpilot.dashboards.annotations import ALERT_NAMES_REGEX, KSM_RESTARTS
from kvpilot.dashboards.panels import (
    COUNT,
    ENGINE,
    INSTANCE,
    PER_SECOND,
    RATIO,
    SCOPE,
    VLLM_CONTAINER,
    Item,
    Query,
    stat_panel,
)
from kvpilot.dashboards.tuning_metrics import LIVE_FLAGS_INFO

# Zero while a kvpilot in scope is up: a counter kvpilot has not incremented yet has no
# series, and a stat must say 0 then, not "No data"; with no kvpilot up it stays empty.
_ZERO_WHILE_UP = f"0 * count(kvpilot_build_info{{{INSTANCE}}})"


def _preemptions_per_second() -> str:
    # The plugin's counter where it runs (counted where the scheduler preempts), else vLLM's.
    kvpool, vllm = (
        f'sum(rate(kvpilot_preemptions_total{{{ENGINE}, counter="{counter}"}}[$__rate_interval]))'
        for counter in ("kvpool", "vllm")
    )
    return f"{kvpool} or {vllm}"


def _promotions_in_range() -> str:
    promoted = f'{LIVE_FLAGS_INFO}{{{INSTANCE}, source="promoted"}}'
    # Promoted flags seen during the range that were not live at its start.
    new = f"max_over_time({promoted}[$__range]) unless {promoted} offset $__range"
    return f"count({new}) or {_ZERO_WHILE_UP}"


def stat_row() -> list[Item]:
    """KV usage and free blocks now, preemptions per second, alerts firing, restarts and
    promotions over the range, and the live flags."""
    return [
        dashboard_builders.Row("Now"),
        stat_panel(
            "KV cache usage",
            "The fullest engine in scope now (vLLM's usage ratio).",
            Query(f"max(kvpilot_kv_usage_ratio{{{ENGINE}}})", "usage"),
            unit=RATIO,
        ),
        stat_panel(
            "Free KV blocks",
            "Free blocks of the engine in scope with the fewest now.",
            Query(f'min(kvpilot_kv_blocks{{{ENGINE}, state="free"}})', "free"),
            unit=COUNT,
        ),
        stat_panel(
            "Preemptions",
            "Preemptions per second over the engines in scope: the plugin's count where it "
            "runs, else vLLM's own (which lags).",
            Query(_preemptions_per_second(), "preemptions"),
            unit=PER_SECOND,
        ),
        stat_panel(
            "Alerts firing",
            "kvpilot's and the vLLM rules' alerts firing now in scope (Prometheus's ALERTS).",
            Query(
                f'count(ALERTS{{{SCOPE}, alertname=~"{ALERT_NAMES_REGEX}", '
                f'alertstate="firing"}}) or {_ZERO_WHILE_UP}',
                "firing",
            ),
            unit=COUNT,
            width=2,
        ),
        stat_panel(
            "Restarts by kvpilot",
            "Remediations that restarted a server and succeeded, over the time range.",
            Query(
                "sum(increase(kvpilot_remediations_total"
                f'{{{INSTANCE}, outcome="succeeded"}}[$__range])) or {_ZERO_WHILE_UP}',
                "restarts",
            ),
            unit=COUNT,
        ),
        stat_panel(
            "vLLM container restarts",
            "Restarts of the vLLM container over the time range, as kube-state-metrics counts "
            "them (empty where it is not scraped; the container's name is a variable).",
            Query(f"sum(increase({KSM_RESTARTS}{{{VLLM_CONTAINER}}}[$__range]))", "restarts"),
            unit=COUNT,
        ),
        stat_panel(
            "Promotions",
            "Flags the tuner promoted over the time range (new promoted live flags).",
            Query(_promotions_in_range(), "promotions"),
            unit=COUNT,
            width=2,
        ),
        stat_panel(
            "Live flags",
            "The flags each stable server runs with now, and where they came from.",
            Query(f"{LIVE_FLAGS_INFO}{{{INSTANCE}}}", "{{server}}: {{flags}} ({{source}})"),
            unit=COUNT,
            width=5,
            show_name=True,
        ),
    ]
