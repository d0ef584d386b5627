"""A server's first start under the OOM guard: a memory death at start-up is stepped.

`kvpilot run` stops when a server fails its first start; where the guard reads the failure
as a memory death (too big, or too small with room above), the step runs through the
remediator like a mid-run one (its guards, audit, promotion record and alert), at most
`oom.max_steps` times and never past a guard's refusal. Any other failure is the caller's.
"""

from __future__ import annotations

from typing import Protocol

from kvpilot.agent.alerts import new_incident_id
from kvpilot.agent.model import Instance
from kvpilot.agent.remediation.execute import find_instance
from kvpilot.agent.remediation.ladder import LadderPlan
from kvpilot.agent.remediation.oom.guard import OomGuard
from kvpilot.agent.remediation.trigger import RemediationOutcome, Trigger
from kvpilot.agent.runtimes.probe import StartFailed
from kvpilot.agent.state.decision import Decision

STARTUP_RULE = "startup"


class _Starts(Protocol):
    def instances(self) -> tuple[Instance, ...]: ...

    async def start(self, name: str, *, ready_timeout_s: float) -> Instance: ...


class _Remediates(Protocol):
    oom: OomGuard | None

    async def remediate(
        self, trigger: Trigger, plan: LadderPlan | None = None
    ) -> RemediationOutcome: ...


async def start_guarded(
    runtime: _Starts, remediator: _Remediates, name: str, *, ready_timeout_s: float
) -> None:
    """Start `name`; after a memory death at start-up, step and restart under the guards.
    Raises the first StartFailed when the guard does not bring the server up."""
    guard = remediator.oom
    if guard is not None:
        guard.started(name)
    try:
        await runtime.start(name, ready_timeout_s=ready_timeout_s)
    except StartFailed:
        if guard is None or not await _recover(runtime, remediator, guard, name):
            raise


async def _recover(runtime: _Starts, remediator: _Remediates, guard: OomGuard, name: str) -> bool:
    for _ in range(guard.config.max_steps):
        instance = find_instance(runtime, name)  # type: ignore[arg-type]  # reads instances only
        if instance is None:
            return False
        trigger = Trigger(name, STARTUP_RULE, None, f"{STARTUP_RULE}-{new_incident_id()}")
        answer = guard.plan(trigger, instance)
        if answer is None or not answer.acted:
            if answer is not None:  # the refusal is audited with its reason
                await remediator.remediate(trigger, answer.plan)
            return False
        outcome = await remediator.remediate(trigger, answer.plan)
        if outcome.decision is Decision.SUCCEEDED:
            return True
        if outcome.decision is not Decision.FAILED:
            return False  # a guard, a veto, a recommendation: nothing more at start-up
    return False
