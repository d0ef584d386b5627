"""The checks in front of a step, each audited: veto, cooldown, budget, breaker, pre-flight.

A check that refuses ends the remediation (skipped or vetoed) by raising `Stopped` with the
outcome already recorded. An operator's `force` overrides the guards and the pre-flight,
never a veto; the override is audited.
"""

from __future__ import annotations

from typing import Protocol

from kvpilot.agent.config import PreflightConfig
from kvpilot.agent.model import Instance
from kvpilot.agent.remediation.audit import AuditTrail
from kvpilot.agent.remediation.guards import CircuitBreaker, Cooldown, GuardDecision, RestartBudget
from kvpilot.agent.remediation.preflight import MemoryCheck
from kvpilot.agent.remediation.progress import InProgress, Run
from kvpilot.agent.remediation.trigger import RemediationOutcome
from kvpilot.agent.remediation.vetoes import Vetoes
from kvpilot.agent.state.decision import Decision


class Preflight(Protocol):
    """Whether the server will have the memory to start again (`MemoryPreflight`)."""

    def check(self, instance: Instance) -> MemoryCheck: ...


class Stopped(Exception):
    """Ends a remediation early with an outcome already recorded."""

    def __init__(self, outcome: RemediationOutcome) -> None:
        super().__init__(outcome.reason)
        self.outcome = outcome


class RemediationChecks:
    """Runs the checks against one remediation; see the module docstring."""

    def __init__(
        self,
        *,
        cooldown: Cooldown,
        budget: RestartBudget,
        breaker: CircuitBreaker,
        vetoes: Vetoes,
        preflight_config: PreflightConfig,
        preflight: Preflight | None,
        progress: InProgress,
        audit: AuditTrail,
    ) -> None:
        self._cooldown = cooldown
        self._budget = budget
        self._breaker = breaker
        self._vetoes = vetoes
        self._preflight_config = preflight_config
        self._preflight = preflight
        self._progress = progress
        self._audit = audit

    def veto(self, run: Run) -> None:
        """A veto that arrived while the remediation waited or ran ends it."""
        vetoed = self._vetoes.against(run.trigger)
        if vetoed is not None:
            raise Stopped(self._progress.end(run, Decision.VETOED, vetoed))

    def guards(self, run: Run, now_s: float) -> None:
        """Cooldown, budget and circuit breaker: every answer audited, the first refusal ends."""
        trigger = run.trigger
        decisions: list[GuardDecision] = [
            self._cooldown.check(trigger.instance, now_s),
            self._budget.check(trigger.instance, now_s),
            self._breaker.check(trigger.instance, now_s),
        ]
        for d in decisions:
            verdict = (
                "allowed" if d.allowed else ("overridden by force" if trigger.force else "blocked")
            )
            self._audit.about(trigger, run.remediation_id, d.guard, verdict, d.reason)
        blocked = [d for d in decisions if not d.allowed]
        if blocked and not trigger.force:
            reason = f"skipped: {blocked[0].reason}"
            raise Stopped(self._progress.end(run, Decision.SKIPPED, reason))

    def preflight(self, run: Run, instance: Instance) -> None:
        """Enough memory to start again; unknown blocks only when configured to."""
        if not self._preflight_config.enabled or self._preflight is None:
            return
        trigger = run.trigger
        try:
            check = self._preflight.check(instance)
        except OSError as exc:
            check = MemoryCheck(None, None, f"pre-flight check failed: {exc}")
        unknown_blocks = self._preflight_config.unknown_blocks_restart
        blocks = check.ok is False or (check.ok is None and unknown_blocks)
        if check.ok is True:
            verdict = "allowed"
        elif not blocks:
            verdict = "allowed (unknown does not block)"
        else:
            verdict = "overridden by force" if trigger.force else "blocked"
        details = {
            "device": check.device,
            "available_bytes": check.available_bytes,
            "required_bytes": check.required_bytes,
        }
        self._audit.about(trigger, run.remediation_id, "preflight", verdict, check.reason, details)
        if blocks and not trigger.force:
            unknown = " (unknown blocks the restart)" if check.ok is None else ""
            reason = f"skipped: pre-flight: {check.reason}{unknown}"
            raise Stopped(self._progress.end(run, Decision.SKIPPED, reason))
