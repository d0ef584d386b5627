"""What a trigger becomes before any step, in the order the checks are made."""

from __future__ import annotations

from kvpilot.agent.model import Action, AlertFacts
from kvpilot.agent.remediation import Trigger
from kvpilot.agent.remediation.ladder import manual_plan, no_better_config
from kvpilot.agent.remediation.triage import Advice, AlertOnly, Declined, Proceed, triage
from kvpilot.agent.state.decision import Decision

from .remediation_helpers import make_instance


def trigger(action: Action | str = Action.RESTART, leak: bool | None = None) -> Trigger:
    return Trigger("vllm-0", "preemption_spike", "fp-1", "inc-1", facts=AlertFacts(action, leak))


def decide(t: Trigger, *, instance=None, plan=None, restarted=False, vetoed=None, asked=None):
    def incident_restarted(incident_id: str) -> bool:
        if asked is not None:
            asked.append(incident_id)
        return restarted

    return triage(
        t,
        plan,
        make_instance() if instance is None else instance,
        light_step_enabled=False,
        better_config=no_better_config,
        incident_restarted=incident_restarted,
        veto=lambda _: vetoed,
    )


def test_unknown_instances_and_canaries_are_declined_before_any_plan() -> None:
    unknown = triage(
        trigger(),
        None,
        None,
        light_step_enabled=False,
        better_config=no_better_config,
        incident_restarted=lambda _: False,
        veto=lambda _: None,
    )
    assert unknown == Declined(Decision.SKIPPED, "unknown instance")
    canary = decide(trigger(), instance=make_instance(role="canary"), plan=manual_plan("x"))
    assert isinstance(canary, Declined) and canary.plan is None  # even an operator's
    assert "canary" in canary.reason


def test_alert_only_and_advice_never_read_the_journal() -> None:
    asked: list[str] = []
    assert isinstance(decide(trigger(Action.ALERT), asked=asked), AlertOnly)
    assert isinstance(decide(trigger("reboot"), asked=asked), AlertOnly)
    advice = decide(trigger(Action.LADDER, leak=False), restarted=True, asked=asked)
    assert isinstance(advice, Advice) and advice.plan.steps == ("recommend_tuning",)
    assert asked == []


def test_an_incident_restarted_once_and_a_veto_decline_the_plan() -> None:
    asked: list[str] = []
    again = decide(
        trigger(), restarted=True, vetoed="vetoed: instance vllm-0 is vetoed", asked=asked
    )
    assert isinstance(again, Declined) and again.decision is Decision.SKIPPED
    assert again.reason == "skipped: incident inc-1 was already restarted once"
    assert again.plan is not None and asked == ["inc-1"]
    vetoed = decide(trigger(), vetoed="vetoed: instance vllm-0 is vetoed")
    assert vetoed == Declined(Decision.VETOED, "vetoed: instance vllm-0 is vetoed", vetoed.plan)


def test_the_ladder_plans_unless_the_caller_brought_a_plan() -> None:
    planned = decide(trigger(Action.LADDER, leak=True))
    assert isinstance(planned, Proceed) and planned.plan.steps == ("restart",)
    assert planned.instance.name == "vllm-0"
    brought = decide(trigger(Action.ALERT), plan=manual_plan("operator asked"))
    assert isinstance(brought, Proceed) and brought.plan.reason == "operator asked"
