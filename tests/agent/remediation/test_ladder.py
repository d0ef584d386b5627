"""Which steps each rule and action lead to, decided on the alert's typed facts."""

from __future__ import annotations

import pytest

from kvpilot.agent.model import Action, AlertFacts
from kvpilot.agent.remediation import plan_for
from kvpilot.agent.remediation.ladder import manual_plan


def notes(action: str | None = None, capacity_leak: bool | None = None) -> AlertFacts:
    """The typed facts a rule configured with `action` puts on its condition."""
    return AlertFacts(Action(action) if action else Action.ALERT, capacity_leak)


def test_facts_without_an_action_are_alert_only_and_unknown_actions_are_not_facts() -> None:
    assert AlertFacts() == AlertFacts(Action.ALERT, None)
    # The configuration admits only these; no annotation text becomes an action.
    assert {a.value for a in Action} == {"alert", "restart", "ladder"}
    with pytest.raises(ValueError):
        Action("reboot")


def test_the_ladder_decides_on_typed_facts() -> None:
    leak = AlertFacts(Action.LADDER, capacity_leak=True)
    assert plan_for("preemption_spike", leak, "i", light_step_enabled=False).steps == ("restart",)
    no_leak = AlertFacts(Action.LADDER, capacity_leak=False)
    plan = plan_for("preemption_spike", no_leak, "i", light_step_enabled=False)
    assert plan.steps == ("recommend_tuning",)
    assert plan.reason.startswith("no capacity-leak signature;")
    unknown = plan_for("preemption_spike", AlertFacts(Action.LADDER), "i", light_step_enabled=False)
    assert unknown.reason.startswith("capacity leak unknown;")


def test_kv_blocks_fragmentation_is_alert_only_by_default_and_restarts_when_configured() -> None:
    default = plan_for(
        "fragmentation_kv_blocks", notes(action="alert"), "i", light_step_enabled=False
    )
    assert default.steps == ()
    assert not default.restarts
    configured = plan_for(
        "fragmentation_kv_blocks", notes(action="restart"), "i", light_step_enabled=False
    )
    assert configured.steps == ("restart",)


def test_allocator_fragmentation_restarts_without_a_light_step() -> None:
    plan = plan_for(
        "fragmentation_allocator", notes(action="restart"), "i", light_step_enabled=True
    )
    # The prefix cache has nothing to do with the CUDA allocator.
    assert plan.steps == ("restart",)


def test_light_step_comes_first_only_when_enabled() -> None:
    rule = "fragmentation_kv_blocks"
    assert plan_for(rule, notes(action="restart"), "i", light_step_enabled=True).steps == (
        "reset_prefix_cache",
        "restart",
    )
    assert plan_for(rule, notes(action="restart"), "i", light_step_enabled=False).steps == (
        "restart",
    )


def test_preemption_ladder_promotes_a_better_configuration() -> None:
    asked = []

    def better(instance: str):
        asked.append(instance)
        return ["python", "-m", "vllm.entrypoints.openai.api_server", "--max-num-seqs", "8"]

    plan = plan_for(
        "preemption_spike",
        notes(action="ladder", capacity_leak=True),
        "vllm-0",
        light_step_enabled=False,
        better_config=better,
    )
    assert plan.steps == ("promote",)
    assert plan.argv is not None and plan.argv[-2:] == ("--max-num-seqs", "8")
    assert asked == ["vllm-0"]


def test_preemption_ladder_restarts_only_for_the_capacity_leak() -> None:
    leak = plan_for(
        "preemption_spike",
        notes(action="ladder", capacity_leak=True),
        "i",
        light_step_enabled=False,
    )
    assert leak.steps == ("restart",) and leak.argv is None
    for signature in (False, None):
        plan = plan_for(
            "preemption_spike",
            notes(action="ladder", capacity_leak=signature),
            "i",
            light_step_enabled=False,
        )
        assert plan.steps == ("recommend_tuning",)
        assert not plan.restarts


def test_preemption_action_restart_is_literal() -> None:
    plan = plan_for(
        "preemption_spike",
        notes(action="restart", capacity_leak=False),
        "i",
        light_step_enabled=False,
    )
    assert plan.steps == ("restart",)


def test_no_or_unknown_action_is_alert_only() -> None:
    plan = plan_for("engine_stall", notes(), "i", light_step_enabled=True)
    assert plan.steps == () and plan.action == "alert"
    assert plan.reason == "engine_stall: action is alert (notify only)"
    # Not one the configuration admits, were one to come anyway: never a restart.
    reboot = AlertFacts("reboot")  # type: ignore[arg-type]
    unknown = plan_for("engine_stall", reboot, "i", light_step_enabled=True)
    assert unknown.steps == () and unknown.action == "reboot"
    assert unknown.reason == "engine_stall: unknown action 'reboot', treated as alert only"


def test_manual_plan_is_a_plain_restart() -> None:
    plan = manual_plan("operator asked")
    assert plan.steps == ("restart",) and plan.reason == "operator asked"


def test_pressure_without_a_leak_recommends_a_lower_admission_cap_not_a_restart() -> None:
    argv = ("vllm", "serve", "m", "--max-num-seqs", "64")
    for rule in ("preemption_spike", "kv_saturation"):
        plan = plan_for(
            rule,
            notes("ladder", capacity_leak=False),
            "vllm-0",
            light_step_enabled=True,
            current_argv=argv,
        )
        assert plan.steps == ("recommend_config",) and not plan.restarts
        assert plan.argv == (*argv, "--max-num-active-seqs", "48")
        assert "--max-num-active-seqs 48" in plan.reason


def test_the_admission_cap_steps_down_from_its_own_value() -> None:
    plan = plan_for(
        "preemption_spike",
        notes("ladder"),
        "vllm-0",
        light_step_enabled=False,
        current_argv=("vllm", "serve", "m", "--max-num-seqs=64", "--max-num-active-seqs=2"),
    )
    assert plan.argv is not None and plan.argv[-2:] == ("--max-num-active-seqs", "1")
    assert "(was 2)" in plan.reason


def test_unknown_caps_fall_back_to_a_tuning_run() -> None:
    for argv in (None, ("vllm", "serve", "m"), ("vllm", "serve", "m", "--max-num-seqs", "1")):
        plan = plan_for(
            "preemption_spike",
            notes("ladder"),
            "vllm-0",
            light_step_enabled=False,
            current_argv=argv,
        )
        assert plan.steps == ("recommend_tuning",)


def test_a_validated_config_still_comes_before_the_cap() -> None:
    better = ("vllm", "serve", "m", "--kv-cache-memory-bytes", "8G")
    plan = plan_for(
        "kv_saturation",
        notes("ladder", capacity_leak=False),
        "vllm-0",
        light_step_enabled=False,
        better_config=lambda instance: better,
        current_argv=("vllm", "serve", "m", "--max-num-seqs", "64"),
    )
    assert plan.steps == ("promote",) and plan.argv == better
