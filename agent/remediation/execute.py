"""Running one remediation's steps: checked, then the light step, the restart and its watch.

In order: a remediation that waited behind a restart of its instance judged again on the
restarted server (its evidence is older), the veto, the guards and the pre-flight (for a
restart), dry-run (decided and audited, nothing done), the light step where planned (cleared:
done), the veto again, then the restart with a drain, and a watch that the condition clears
within the verify window. A restart that raised or did not clear the condition failed and
counts against the breaker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvpilot.agent.config import RemediationConfig
from kvpilot.agent.mode import Mode, ModeSetting
from kvpilot.agent.model import Instance
from kvpilot.agent.remediation.audit import AuditTrail
from kvpilot.agent.remediation.breaker_book import BreakerBook
from kvpilot.agent.remediation.checks import RemediationChecks, Stopped
from kvpilot.agent.remediation.guards import Cooldown, RestartBudget
from kvpilot.agent.remediation.journal import RESTART_FAILED, VERIFY_FAILED
from kvpilot.agent.remediation.prefix_cache import LightStep
from kvpilot.agent.remediation.progress import InProgress, Run
from kvpilot.agent.remediation.trigger import TUNING_RULE, RemediationOutcome
from kvpilot.agent.remediation.watch import ConditionWatch, WatchWindows
from kvpilot.agent.runtimes.base import FlagsNotApplied
from kvpilot.agent.state.decision import Decision

log = logging.getLogger(__name__)


class RestartTarget(Protocol):
    """What the remediator needs of a runtime."""

    @property
    def can_change_flags(self) -> bool: ...

    def instances(self) -> tuple[Instance, ...]: ...

    async def restart(
        self,
        name: str,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        argv: Sequence[str] | None = None,
    ) -> Instance: ...


# Told of each promotion the runtime applied: (instance, argv, reason).
Promoted = Callable[[str, tuple[str, ...], str], None]


@dataclass(frozen=True, slots=True)
class LastRestart:
    """An instance's last restart by a remediation: which one, and how many so far."""

    remediation_id: int
    count: int


def find_instance(runtime: RestartTarget, name: str) -> Instance | None:
    return next((i for i in runtime.instances() if i.name == name), None)


class Executor:
    """Takes one opened remediation through its steps to its outcome."""

    def __init__(
        self,
        *,
        config: RemediationConfig,
        runtime: RestartTarget,
        checks: RemediationChecks,
        progress: InProgress,
        audit: AuditTrail,
        book: BreakerBook,
        cooldown: Cooldown,
        budget: RestartBudget,
        watch: ConditionWatch,
        windows: WatchWindows,
        light_step: LightStep | None,
        drain_timeout_s: float,
        clock: Callable[[], float],
        mode: Callable[[], ModeSetting],
        on_promoted: Promoted | None = None,
    ) -> None:
        self._config = config
        self._mode = mode
        self._runtime = runtime
        self._checks = checks
        self._progress = progress
        self._audit = audit
        self._book = book
        self._cooldown = cooldown
        self._budget = budget
        self._watch = watch
        self._windows = windows
        self._light_step = light_step
        self._drain_timeout_s = drain_timeout_s
        self._clock = clock
        self._on_promoted = on_promoted
        self._last_restart: dict[str, LastRestart] = {}

    def restarts_of(self, instance: str) -> int:
        """How many restarts of `instance` remediations have carried out."""
        last = self._last_restart.get(instance)
        return last.count if last is not None else 0

    async def run(self, run: Run) -> RemediationOutcome:
        try:
            return await self._steps(run)
        except Stopped as stop:
            return stop.outcome

    async def _steps(self, run: Run) -> RemediationOutcome:
        plan = run.plan
        instance = find_instance(self._runtime, run.trigger.instance)
        if instance is None:
            return self._progress.end(run, Decision.SKIPPED, "skipped: instance gone")
        superseded = self._superseded(run)
        if superseded is not None:
            return self._progress.end(run, Decision.SKIPPED, superseded)
        self._checks.veto(run)
        setting = self._mode()
        if setting.mode is Mode.PAUSED:  # read again here: the switch may move while queued
            reason = f"skipped: kvpilot is paused ({setting.describe()})"
            return self._progress.end(run, Decision.SKIPPED, reason)
        now_s = self._clock()
        if plan.restarts:
            self._checks.guards(run, now_s)
            # A promotion is checked with the flags it will run (an OOM step's smaller KV).
            flags = instance if plan.argv is None else replace(instance, argv=plan.argv)
            self._checks.preflight(run, flags)
        if setting.mode is Mode.DRY_RUN:
            reason = (
                f"dry-run: would {' then '.join(plan.steps)} ({plan.reason}); "
                f"mode {setting.describe()}"
            )
            return self._progress.end(run, Decision.DRY_RUN, reason)
        if "reset_prefix_cache" in plan.steps:
            cleared = await self._light(run, instance, now_s)
            if cleared is not None:
                return cleared
            self._checks.veto(run)
        return await self._restart(run, instance)

    def _superseded(self, run: Run) -> str | None:
        """Why a remediation planned before its instance's last restart is not carried out.

        It waited behind that restart (one remediation at a time per instance), and its
        evidence is from before it, often from the drain itself. Only a condition still active
        on the restarted server carries it on; an operator's request (no fingerprint) always
        does."""
        trigger = run.trigger
        last = self._last_restart.get(trigger.instance)
        if trigger.fingerprint is None or last is None or last.count <= run.restarts_before:
            return None
        now = self._watch.latest(trigger.fingerprint)
        if now == "active":
            return None
        return (
            f"skipped: superseded by remediation {last.remediation_id}, which restarted "
            f"{trigger.instance} after this one was planned; the condition is {now} since"
        )

    async def _light(self, run: Run, instance: Instance, now_s: float) -> RemediationOutcome | None:
        """The prefix-cache reset: the outcome when it cleared the condition, else None."""
        assert self._light_step is not None  # the plan has the step only when enabled
        trigger, rid = run.trigger, run.remediation_id
        self._cooldown.record(trigger.instance, now_s)
        result = await self._light_step.reset_prefix_cache(instance)
        self._audit.about(
            trigger, rid, "reset_prefix_cache", "done" if result.ok else "failed", result.reason
        )
        if not result.ok or trigger.fingerprint is None:
            return None
        watched = await self._watch.wait(
            trigger.fingerprint, self._clock() + self._windows.after_light_step_s
        )
        if watched.verdict != "cleared":
            self._audit.about(
                trigger,
                rid,
                "reset_prefix_cache",
                "escalate",
                f"still {watched.verdict}: {watched.reason}; going on to the restart",
            )
            return None
        return self._progress.end(run, Decision.SUCCEEDED, "the light step cleared the condition")

    async def _restart(self, run: Run, instance: Instance) -> RemediationOutcome:
        """Drain, restart and verify: the runtime's answer, then the condition's."""
        trigger, plan = run.trigger, run.plan
        now_s = self._clock()
        # A tuning restart (a canary switched in and back) is no sign of a sick instance: it
        # spends the restart budget, not the cooldown that spaces remediations.
        if trigger.rule != TUNING_RULE:
            self._cooldown.record(trigger.instance, now_s)
        self._budget.record(trigger.instance, now_s)
        self._book.attempt(trigger.instance, now_s)
        drain = (
            f"SIGTERM; vLLM drains in-flight requests for up to "
            f"{self._drain_timeout_s:g} s, then the runtime starts it again"
        )
        self._progress.step(run, "draining", drain)
        self._progress.step(run, "restarting", f"{plan.journal_action} through the runtime")
        try:
            new = await self._runtime.restart(
                trigger.instance,
                drain_timeout_s=self._drain_timeout_s,
                ready_timeout_s=self._config.verify_timeout_s,
                argv=plan.argv,
            )
        except FlagsNotApplied as exc:  # recommend-only: written down for a person to apply
            return self._progress.end(
                run, Decision.SKIPPED, str(exc), audited_as=Decision.RECOMMENDED
            )
        except Exception as exc:  # any runtime failure is this remediation's failure
            log.warning("restart of %s failed: %s", trigger.instance, exc)
            return self._failed(run, f"{RESTART_FAILED}{type(exc).__name__}: {exc}")
        if plan.argv is not None and self._on_promoted is not None:
            self._on_promoted(trigger.instance, plan.argv, plan.reason)  # these flags run now
        new_pid = new.main_pid
        self._progress.step(
            run,
            "verifying",
            f"new PID {new_pid}, healthy, probe answered; watching the condition",
            new_pid=new_pid,
        )
        restarted_at_s = self._clock()
        restarts = self.restarts_of(trigger.instance) + 1
        self._last_restart[trigger.instance] = LastRestart(run.remediation_id, restarts)
        if trigger.fingerprint is None:
            return self._progress.end(
                run,
                Decision.SUCCEEDED,
                "restarted: healthy and a probe answered",
                new_pid=new_pid,
            )
        window_s = self._windows.after_restart_s
        watched = await self._watch.wait(trigger.fingerprint, restarted_at_s + window_s)
        if watched.verdict != "cleared":
            reason = (
                f"{VERIFY_FAILED}condition {watched.verdict} "
                f"{window_s:g} s after the restart: {watched.reason}"
            )
            return self._failed(run, reason, new_pid=new_pid)
        self._book.watch_recurrence(
            trigger.fingerprint, trigger.instance, restarted_at_s, run.remediation_id
        )
        return self._progress.end(
            run,
            Decision.SUCCEEDED,
            f"condition cleared {watched.at_s - restarted_at_s:.0f} s after the restart",
            new_pid=new_pid,
        )

    def _failed(self, run: Run, reason: str, *, new_pid: int | None = None) -> RemediationOutcome:
        """A restart that did not help: failed, escalated to the circuit breaker."""
        outcome = self._progress.end(
            run, Decision.FAILED, reason, new_pid=new_pid, audited_as=Decision.ESCALATED
        )
        self._book.failure(run.trigger.instance, self._clock(), reason)
        return outcome
