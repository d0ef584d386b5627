"""What a trigger becomes before any step: declined, alert only, advice, or a plan to run.

In order: an unknown instance and a canary (the tuner's judge acts on canaries) are
declined; the ladder plans the steps from the alert's facts unless the caller brought a
plan; no steps is alert only; a recommendation is advice; an incident whose server may
already have been restarted once, and a vetoed one, are declined. Only `Proceed` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.agent.model import Instance
from kvpilot.agent.remediation.ladder import ADVICE_STEPS, BetterConfig, LadderPlan, plan_for
from kvpilot.agent.remediation.trigger import Trigger
from kvpilot.agent.state.decision import Decision


@dataclass(frozen=True, slots=True)
class Declined:
    """Not run: recorded as a finished remediation with this decision."""

    decision: Decision
    reason: str
    plan: LadderPlan | None = None


@dataclass(frozen=True, slots=True)
class AlertOnly:
    """The rule notifies only: audited, no remediation recorded."""

    plan: LadderPlan


@dataclass(frozen=True, slots=True)
class Advice:
    """A restart would not help, or cannot apply the flags that would: a tuning run, or the
    tuner's validated configuration, is recommended instead."""

    plan: LadderPlan


@dataclass(frozen=True, slots=True)
class Proceed:
    """Run these steps on this instance."""

    plan: LadderPlan
    instance: Instance


def triage(
    trigger: Trigger,
    plan: LadderPlan | None,
    instance: Instance | None,
    *,
    light_step_enabled: bool,
    better_config: BetterConfig,
    can_change_flags: bool = True,
    incident_restarted: Callable[[str], bool],
    veto: Callable[[Trigger], str | None],
) -> Declined | AlertOnly | Advice | Proceed:
    """See the module docstring; the journal is read, nothing is written."""
    if instance is None:
        return Declined(Decision.SKIPPED, "unknown instance")
    if instance.role == "canary":
        return Declined(Decision.SKIPPED, "skipped: canary (the tuner's judge acts on canaries)")
    if plan is None:
        plan = plan_for(
            trigger.rule,
            trigger.facts,
            trigger.instance,
            light_step_enabled=light_step_enabled,
            better_config=better_config,
            can_change_flags=can_change_flags,
            current_argv=instance.argv,
        )
    if not plan.steps:
        return AlertOnly(plan)
    if plan.steps in ADVICE_STEPS:
        return Advice(plan)
    if trigger.incident_id is not None and incident_restarted(trigger.incident_id):
        reason = f"skipped: incident {trigger.incident_id} was already restarted once"
        return Declined(Decision.SKIPPED, reason, plan)
    vetoed = veto(trigger)
    if vetoed is not None:
        return Declined(Decision.VETOED, vetoed, plan)
    return Proceed(plan, instance)
