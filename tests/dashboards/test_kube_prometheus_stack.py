"""kube-prometheus-stack's defaults pick up what kvpilot ships once the label is given: its
Prometheus selects ServiceMonitors, PodMonitors and PrometheusRules labelled
`release: <release>` (`serviceMonitorSelector`, `podMonitorSelector`, `ruleSelector`, each
`matchLabels: {release: <release>}` while `*SelectorNilUsesHelmValues` is true, its default).
Checked statically: no API server or operator runs here."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml
from typer.testing import CliRunner

from kvpilot.agent.cli.main import app
from kvpilot.dashboards.self_watch import SelfWatch
from tests.dashboards.kustomize_builds import DEPLOY, kubectl, post_rendered
from tests.dashboards.test_helm_post_renderer import CHART_OUTPUT, KVPILOT_UID

RELEASE = "kps"
# The chart's Prometheus, as it renders with its default values (release "kps").
SELECTORS = {
    "ServiceMonitor": {"matchLabels": {"release": RELEASE}},
    "PodMonitor": {"matchLabels": {"release": RELEASE}},
    "PrometheusRule": {"matchLabels": {"release": RELEASE}},
}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) on `labels`."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or ():
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        held = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in (values or ()),
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not held:
            return False
    return True


def _selected(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {
        (d["kind"], d["metadata"]["name"])
        for d in docs
        if d["kind"] in SELECTORS
        and selects(SELECTORS[d["kind"]], d["metadata"].get("labels") or {})
    }


def _base_with_label(tmp_path: Path, label: bool) -> list[dict[str, Any]]:
    """deploy/base under a user's overlay that adds the release label (kustomize `labels`)."""
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(DEPLOY / "base", tmp_path)],
                **({"labels": [{"pairs": {"release": RELEASE}}]} if label else {}),
            }
        )
    )
    result = subprocess.run(
        [str(kubectl()), "kustomize", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _rule(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, ["rules", "--format", "prometheusrule", *args])
    assert result.exit_code == 0, result.output
    return dict(yaml.safe_load(result.stdout))


def test_the_defaults_select_the_base_and_the_rules_given_the_release_label(
    tmp_path: Path,
) -> None:
    labelled = _base_with_label(tmp_path, label=True)
    assert {("ServiceMonitor", "vllm"), ("PrometheusRule", "kvpilot")} <= _selected(labelled)
    assert _selected([_rule("--label", f"release={RELEASE}")]) == {("PrometheusRule", "kvpilot")}
    # Without it, kube-prometheus-stack picks up nothing: the label is what makes the match.
    assert _selected([_rule()]) == set()


def test_the_defaults_select_the_injected_pods_podmonitor_given_the_label() -> None:
    docs = list(post_rendered(CHART_OUTPUT.read_text(), KVPILOT_UID, f"--label=release={RELEASE}"))
    assert ("PodMonitor", "kvpilot") in _selected(docs)
    assert _selected(list(post_rendered(CHART_OUTPUT.read_text(), KVPILOT_UID))) == set()


def test_the_podmonitors_job_is_the_one_the_rules_select() -> None:
    """The operator names a PodMonitor's job `<namespace>/<name>` unless `jobLabel` names a pod
    label: the injected pod's value of it is the job the self-watch rules select."""
    docs = {
        (d["kind"], d["metadata"]["name"]): d
        for d in post_rendered(CHART_OUTPUT.read_text(), KVPILOT_UID)
    }
    monitor = docs[("PodMonitor", "kvpilot")]
    pod_labels = docs[("Deployment", "vllm-tiny-deployment-vllm")]["spec"]["template"]["metadata"][
        "labels"
    ]
    assert selects(monitor["spec"]["selector"], pod_labels)
    assert pod_labels[monitor["spec"]["jobLabel"]] == SelfWatch().job
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (kvpilot,) = [
        c
        for c in docs[("Deployment", "vllm-tiny-deployment-vllm")]["spec"]["template"]["spec"][
            "containers"
        ]
        if c["name"] == "kvpilot"
    ]
    assert endpoint["port"] in {p["name"] for p in kvpilot["ports"]}
    rules = _rule("--job", "monitoring/kvpilot")["spec"]["groups"]
    exprs = [r["expr"] for g in rules for r in g["rules"] if "job=" in r["expr"]]
    assert exprs and all('job="monitoring/kvpilot"' in e for e in exprs)
