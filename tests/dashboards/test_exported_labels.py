"""Every label a generated rule or a dashboard query selects, groups or joins on is a label
of a series kvpilot exports (rendered by its exposition module) or vLLM exports (recorded),
as a plain Prometheus or kube-prometheus-stack stores them; kube-state-metrics' restart
counter is the one named external source."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import yaml
from dashboard_queries import annotation_queries, fill, panel_queries, variable_queries
from exported_series import (
    KSM_PAYLOAD,
    VLLM_PAYLOADS,
    Series,
    agent_target,
    in_kubernetes,
    kube_state_metrics_series,
    kvpilot_series,
    label_sets,
    up_series,
    vllm_series,
)
from promql_labels import check, result_labels

from kvpilot.agent.cli.dashboards_cmd import runbooks
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.dashboards.build import build_dashboards
from kvpilot.dashboards.rules import build_rules


def _own_series() -> tuple[Series, ...]:
    """kvpilot's and vLLM's series (every recorded vLLM payload) and Prometheus's `up`."""
    return (
        *kvpilot_series(),
        *kvpilot_series(kvpool=False),
        *(s for payload in VLLM_PAYLOADS for s in vllm_series(payload=payload)),
        up_series("kvpilot", agent_target("a")),
    )


# Series no kvpilot or vLLM exports, read from a named source: kube-state-metrics.
EXTERNAL = {KSM_PAYLOAD.parent.name: kube_state_metrics_series}


def exported() -> dict[str, frozenset[str] | None]:
    """Label names per metric: kvpilot's and vLLM's as a plain Prometheus and as
    kube-prometheus-stack store them, the named external sources', and Prometheus's own `up`
    and `ALERTS`."""
    own = _own_series()
    series = (
        *own,
        *in_kubernetes(own, pod="vllm-7d9f8b6c5-x2k4q", container="kvpilot"),
        *(s for source in EXTERNAL.values() for s in source()),
    )
    known: dict[str, frozenset[str] | None] = dict(label_sets(series))
    known["ALERTS"] = None  # the labels of whichever alert fired
    return known


def _rules() -> list[dict]:
    text = build_rules(RulesConfig(), runbooks=runbooks()).rules_file()
    return [rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"]]


def with_recorded(known: Mapping[str, frozenset[str] | None]) -> dict[str, frozenset[str] | None]:
    """`known` plus each recording rule's series, with the labels its expression leaves."""
    out = dict(known)
    for rule in _rules():
        if "record" in rule:
            labels = result_labels(rule["expr"], out)
            out[rule["record"]] = None if labels is None else labels | set(rule.get("labels", {}))
    return out


KNOWN = with_recorded(exported())


@pytest.mark.parametrize(
    "rule", _rules(), ids=lambda rule: rule.get("alert") or rule.get("record") or "?"
)
def test_every_rule_uses_only_exported_labels(rule: dict) -> None:
    problems = check(rule["expr"], KNOWN)
    assert not problems, "\n".join(map(str, problems))


def _dashboard_queries() -> list[tuple[str, str]]:
    out = []
    for dashboard in build_dashboards():
        model = dashboard.model()
        for query in (*panel_queries(model), *annotation_queries(model)):
            out.append((f"{dashboard.uid}: {query.panel} {query.ref_id}", query.expr))
    return out


@pytest.mark.parametrize(("panel", "expr"), _dashboard_queries(), ids=lambda v: str(v)[:60])
def test_every_panel_and_annotation_uses_only_exported_labels(panel: str, expr: str) -> None:
    problems = check(fill(expr), KNOWN)
    assert not problems, f"{panel}: " + "\n".join(map(str, problems))


def test_every_template_variable_reads_an_exported_label() -> None:
    problems = []
    for dashboard in build_dashboards():
        for query in variable_queries(dashboard.model()):
            inner = query.removeprefix("label_values(").removesuffix(")")
            selector, _, label = inner.rpartition(",")
            selector = fill(selector)
            problems += [f"{query}: {p}" for p in check(selector, KNOWN)]
            labels = result_labels(selector, KNOWN)
            if labels is not None and label.strip() not in labels:
                problems.append(f"{query}: no {label.strip()!r} in {sorted(labels)}")
    assert not problems, "\n".join(problems)


def test_the_check_reads_the_labels_the_exposition_writes() -> None:
    # The checks above prove something only if the exposition's families are all there.
    known = label_sets(_own_series())
    assert known["kvpilot_gpu_process_memory_bytes"] == {
        "instance",
        "job",
        "gpu",
        "uuid",
        "pid",
        "owner",
        "server",
    }
    assert "le" in (known["vllm:time_to_first_token_seconds_bucket"] or ())
    problems = check('kvpilot_gpu_process_memory_bytes{role="server"}', known)
    assert [(p.label, p.use) for p in problems] == [("role", "selects")]


def test_only_the_named_external_source_adds_series() -> None:
    # kvpilot's and vLLM's own series name no kube-state-metrics family; the one the
    # dashboards read comes from its named sample, with the labels the dashboards select.
    own = {s.name for s in _own_series()}
    (external,) = EXTERNAL.values()
    names = {s.name for s in external()}
    assert names == {"kube_pod_container_status_restarts_total"} and not names & own
    assert {"namespace", "pod", "container"} <= label_sets(external())[next(iter(names))]


def test_the_scope_variables_select_labels_only_a_kubernetes_scrape_adds() -> None:
    # On a plain Prometheus kvpilot's series carry no cluster, namespace or pod: the
    # dashboards' scope matchers prove nothing unless the check sees them fail there.
    plain = dict(label_sets(_own_series()))
    problems = check(fill('kvpilot_build_info{cluster=~"$cluster", pod=~"$pod"}'), plain)
    assert [(p.label, p.use) for p in problems] == [("cluster", "selects"), ("pod", "selects")]
    assert not check(fill('kvpilot_build_info{cluster=~"$cluster", pod=~"$pod"}'), KNOWN)
