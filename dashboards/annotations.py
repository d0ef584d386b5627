"""The events both dashboards mark on their time axis: alerts, remediations, promotions,
finished trials and restarts of the vLLM container."""

from __future__ import annotations

from collections.abc import Sequence

from grafana_foundation_sdk.builders import dashboard as dashboard_builders

from kvpilot.dashboards.panels import DATASOURCE, INSTANCE, SCOPE, VLLM_CONTAINER
from kvpilot.dashboards.tuning_metrics import LIVE_FLAGS_INFO, TRIAL_INFO

# Alert names whose states the dashboards mark (the agent's rules and kvpilot's self-watch).
ALERT_NAMES_REGEX = "Vllm.*|Kvpilot.*"
# kube-state-metrics' restart counter of a container: not kvpilot's, read where it is scraped.
KSM_RESTARTS = "kube_pod_container_status_restarts_total"
# A new series of an info family (new flags, a trial's new state) is an event: present now,
# absent a minute before (longer than a scrape, one step of Grafana's annotation queries).
_NEW_FOR = "1m"


def _new(selector: str) -> str:
    return f"{selector} unless {selector} offset {_NEW_FOR}"


def _annotation(name: str, colour: str, expr: str) -> dashboard_builders.AnnotationQuery:
    return (
        dashboard_builders.AnnotationQuery()
        .name(name)
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color(colour)
        .expr(expr)
    )


def annotation_queries() -> Sequence[dashboard_builders.AnnotationQuery]:
    """Alert states (Prometheus's ALERTS series), the agent's remediations, the tuner's
    promotions (the live flags turning to new promoted ones) and finished trials, and the
    vLLM container's restarts as kube-state-metrics counts them."""
    return (
        _annotation(
            "kvpilot alerts",
            "red",
            f'ALERTS{{{SCOPE}, alertname=~"{ALERT_NAMES_REGEX}", alertstate="firing"}}',
        ),
        _annotation(
            "kvpilot remediations",
            "orange",
            f"increase(kvpilot_remediations_total{{{INSTANCE}}}[$__rate_interval]) > 0",
        ),
        _annotation(
            "kvpilot promotions",
            "green",
            _new(f'{LIVE_FLAGS_INFO}{{{INSTANCE}, source="promoted"}}'),
        ),
        _annotation("kvpilot trials", "blue", _new(f"{TRIAL_INFO}{{{INSTANCE}}}")),
        _annotation(
            "vLLM container restarts",
            "purple",
            f"increase({KSM_RESTARTS}{{{VLLM_CONTAINER}}}[$__rate_interval]) > 0",
        ),
    )
