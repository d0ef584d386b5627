"""A Deployment's `kvpilot.dev/<path>` annotations over the shared configuration: the
allowlist, values read as YAML scalars within bounds, refusal by name, whole or nothing. The
shared configuration is the tuning overlay's ConfigMap as shipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvpilot.agent.config import AgentConfig, PodRuntimeConfig, validate_config
from kvpilot.agent.config.per_deployment import (
    MAX_SETTINGS,
    MAX_VALUE_CHARS,
    PER_DEPLOYMENT,
    is_setting_name,
    layer_settings,
    per_deployment,
)

ROOT = Path(__file__).resolve().parents[3]
SETTINGS_MODULES = {"per_deployment", "deployment_settings"}  # they name settings annotations


def shipped(overlay: str = "deploy/overlays/tuning") -> AgentConfig:
    configmap = yaml.safe_load((ROOT / overlay / "kvpilot-config.yaml").read_text())
    return validate_config(yaml.safe_load(configmap["data"]["kvpilot.yaml"]), warn=False)


def test_allowed_settings_override_the_shared_ones_and_the_rest_stays() -> None:
    shared = shipped()
    layered = layer_settings(
        shared,
        {
            "kvpilot.dev/tuning.schedule": "*/30 2 * * *",  # YAML would read `*` as an alias
            "kvpilot.dev/tuning.trials": "5",
            "kvpilot.dev/tuning.slo.ttft_p95_s": "1.5",
            "kvpilot.dev/runtime.kubernetes.restarting_at_once": "2",
            "kvpilot.dev/runtime.kubernetes.promotion_surge": "25%",
            "kvpilot.dev/rules.fragmentation.kv_blocks.threshold_ratio": "0.5",
            "kvpilot.dev/mode": "paused",  # the switch's, not a setting
            "kvpilot.dev/recommendation": "{}",
            "app.kubernetes.io/tuning.schedule": "0 1 * * *",  # another prefix: not ours
        },
    )
    assert layered.problems == ()
    config = layered.config
    assert isinstance(config.runtime, PodRuntimeConfig)
    assert config.tuning.schedule == "*/30 2 * * *"
    assert (config.tuning.trials, config.tuning.slo.ttft_p95_s) == (5, 1.5)
    assert config.runtime.kubernetes.restarting_at_once == 2
    assert config.runtime.kubernetes.promotion_surge == "25%"
    assert config.rules.fragmentation.kv_blocks.threshold_ratio == 0.5
    # What the annotations did not name is the ConfigMap's, untouched.
    assert config.tuning.slo.inter_token_p95_s == shared.tuning.slo.inter_token_p95_s == 0.2
    assert config.tuning.max_num_seqs == 256 and config.runtime.kubernetes.handover == "configmap"
    assert layered.from_deployment == {
        "tuning.schedule": "*/30 2 * * *",
        "tuning.trials": "5",
        "tuning.slo.ttft_p95_s": "1.5",
        "runtime.kubernetes.restarting_at_once": "2",
        "runtime.kubernetes.promotion_surge": "25%",
        "rules.fragmentation.kv_blocks.threshold_ratio": "0.5",
    }


def test_values_are_yaml_scalars() -> None:
    layered = layer_settings(
        shipped(), {"kvpilot.dev/tuning.schedule": "null", "kvpilot.dev/tuning.windows": "4"}
    )
    assert layered.problems == ()
    assert layered.config.tuning.schedule is None  # this Deployment is not tuned on a schedule
    assert layered.config.tuning.windows == 4
    refused = layer_settings(shipped(), {"kvpilot.dev/tuning.trials": "[3, 4]"})
    assert refused.problems == ("kvpilot.dev/tuning.trials: one value, not a list or a mapping",)


@pytest.mark.parametrize(
    ("annotations", "problem"),
    [
        ({"kvpilot.dev/tuning.shedule": "0 1 * * *"}, "no such setting; did you mean 'schedule'?"),
        ({"kvpilot.dev/tunig.trials": "3"}, "no such setting; did you mean 'tuning'?"),
        ({"kvpilot.dev/remediation.dry_run": "false"}, "not a per-Deployment setting"),
        ({"kvpilot.dev/rules.kv_saturation.action": "restart"}, "not a per-Deployment setting"),
        ({"kvpilot.dev/runtime.kubernetes.promote": "apply"}, "not a per-Deployment setting"),
        ({"kvpilot.dev/notifiers": "[]"}, "not a per-Deployment setting"),
        ({"kvpilot.dev/tuning.trials": "0"}, "greater than or equal to 1"),
        ({"kvpilot.dev/tuning.schedule": "every night"}, "not a crontab line"),
    ],
)
def test_a_refused_annotation_is_named_and_nothing_applies(
    annotations: dict[str, str], problem: str
) -> None:
    shared = shipped()
    both = {
        **annotations,
        "kvpilot.dev/tuning.trials": annotations.get("kvpilot.dev/tuning.trials", "7"),
    }
    layered = layer_settings(shared, both)
    assert layered.config is shared  # whole: the good annotation beside it is not applied
    assert layered.settings == () and layered.from_deployment == {}
    (said,) = layered.problems
    key = next(iter(annotations))
    assert said.startswith(f"{key}:") and problem in said


def test_a_problem_of_two_settings_together_refuses_both() -> None:
    shared = shipped()
    layered = layer_settings(
        shared, {"kvpilot.dev/tuning.min_num_seqs": "64", "kvpilot.dev/tuning.max_num_seqs": "8"}
    )
    assert layered.config is shared and len(layered.problems) == 1
    assert "with the Deployment's settings" in layered.problems[0]


def test_bounds() -> None:
    shared = shipped()
    long_value = layer_settings(
        shared, {"kvpilot.dev/tuning.schedule": "0" * (MAX_VALUE_CHARS + 1)}
    )
    assert long_value.problems == (
        f"kvpilot.dev/tuning.schedule: a value longer than {MAX_VALUE_CHARS} characters",
    )
    long_name = layer_settings(shared, {"kvpilot.dev/tuning." + "x" * 80: "1"})
    assert "a name longer than 63 characters" in long_name.problems[0]
    many = {f"kvpilot.dev/rules.x{i}.for_s": "1" for i in range(MAX_SETTINGS + 1)}
    too_many = layer_settings(shared, many)
    assert too_many.config is shared
    assert too_many.problems == (
        f"{MAX_SETTINGS + 1} settings annotations, more than the {MAX_SETTINGS} read",
    )


def test_the_allowlist_names_real_settings_and_every_rule_number() -> None:
    shared = shipped()
    for path in PER_DEPLOYMENT:  # each one a field the models know, on the pod runtime
        value = "2" if "surge" not in path else "1"
        if path == "tuning.schedule":
            value = "0 1 * * *"
        layered = layer_settings(shared, {f"kvpilot.dev/{path}": value})
        assert not any("no such setting" in p for p in layered.problems), path
    assert per_deployment("rules.preemption_spike.floor_per_s")
    assert per_deployment("rules.gpu_memory_growth.min_growth_bytes")
    assert not per_deployment("rules.preemption_spike.enabled")  # a bool is not a threshold
    assert not per_deployment("rules.preemption_spike.severity")
    assert not per_deployment("rules.external_labels")


def test_kvpilots_other_annotations_are_not_settings() -> None:
    """Every other `kvpilot.dev/` name in the code and the manifests is left alone."""
    names = set()
    for folder in ("agent", "deploy", "tuner"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".yaml"} and path.stem not in SETTINGS_MODULES:
                names |= set(re.findall(r"kvpilot\.dev/([A-Za-z0-9_-]+)\b", path.read_text()))
    assert {"mode", "recommendation", "inject", "canary-of", "handover-sha256"} <= names
    assert not [name for name in names if is_setting_name(name)]
