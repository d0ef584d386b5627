"""The remediations in progress: their journal records step by step, their locks and tasks.

A record is written before the step it announces is taken, so a crash leaves a record of how
far the remediation got. One remediation at a time per instance (an asyncio lock); each runs
as a task the remediator keeps until it ends, whoever started it (the tick, the API), so that
shutdown interrupts every one. However a remediation ends (its steps, a cancellation at
shutdown, a bug) its record is finished and audited.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvpilot.agent.model import Instance
from kvpilot.agent.remediation.audit import AuditTrail
from kvpilot.agent.remediation.journal import (
    INTERRUPTED_AFTER_RESTART_BEGAN,
    NOT_RESTARTED,
    RESTART_STATES,
    RemediationJournal,
)
from kvpilot.agent.remediation.ladder import LadderPlan
from kvpilot.agent.remediation.trigger import RemediationOutcome, Trigger
from kvpilot.agent.state.decision import Decision

if TYPE_CHECKING:
    from kvpilot.agent.state.store import RemediationState

log = logging.getLogger(__name__)

# The journal state a remediation's record ends in, by its decision.
FINAL_STATE: dict[Decision, RemediationState] = {
    Decision.SUCCEEDED: "succeeded",
    Decision.FAILED: "failed",
    Decision.SKIPPED: "skipped",
    Decision.VETOED: "vetoed",
    Decision.DRY_RUN: "skipped",  # nothing was done
}


@dataclass(frozen=True, slots=True)
class ActiveRemediation:
    """A remediation not finished yet, for the status API and the tuner."""

    remediation_id: int
    instance: str
    incident_id: str | None
    action: str
    state: RemediationState
    since_wall_s: float


@dataclass(frozen=True, slots=True)
class Run:
    """One remediation with an open journal record: what the steps act on."""

    remediation_id: int
    trigger: Trigger
    plan: LadderPlan
    restarts_before: int  # its instance's restarts when planned: a later one makes it stale


class InProgress:
    """Opens, moves on and finishes journal records; keeps the locks and the tasks."""

    def __init__(
        self, journal: RemediationJournal, audit: AuditTrail, wall_clock: Callable[[], float]
    ) -> None:
        self._journal = journal
        self._audit = audit
        self._wall_clock = wall_clock
        self._active: dict[int, ActiveRemediation] = {}
        self._old_pids: dict[int, int | None] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def any(self) -> bool:
        return bool(self._active)

    def active(self) -> tuple[ActiveRemediation, ...]:
        return tuple(self._active.values())

    # -- journal records ---------------------------------------------------------------

    def decided(
        self, trigger: Trigger, decision: Decision, reason: str, plan: LadderPlan | None = None
    ) -> RemediationOutcome:
        """A remediation decided before it started: one finished record and its audit."""
        action = plan.journal_action if plan else "remediate"
        rid = self._journal.start_remediation(
            instance=trigger.instance,
            action=action,
            state=FINAL_STATE[decision],
            reason=reason,
            started_wall_s=self._wall_clock(),
            incident_id=trigger.incident_id,
            fingerprint=trigger.fingerprint,
        )
        self._audit.about(trigger, rid, action, decision, reason)
        steps = plan.steps if plan else ()
        return RemediationOutcome(
            trigger.instance, trigger.incident_id, decision, reason, rid, steps
        )

    def open(
        self, trigger: Trigger, plan: LadderPlan, instance: Instance, *, restarts_before: int
    ) -> Run:
        """The record of a remediation about to run, planned; active from now on."""
        action = plan.journal_action
        rid = self._journal.start_remediation(
            instance=trigger.instance,
            action=action,
            state="planned",
            reason=plan.reason,
            started_wall_s=self._wall_clock(),
            incident_id=trigger.incident_id,
            fingerprint=trigger.fingerprint,
            old_pid=instance.main_pid,
        )
        self._active[rid] = ActiveRemediation(
            rid, trigger.instance, trigger.incident_id, action, "planned", self._wall_clock()
        )
        self._old_pids[rid] = instance.main_pid
        self._audit.about(
            trigger, rid, action, Decision.PLANNED, plan.reason, {"steps": plan.steps}
        )
        return Run(rid, trigger, plan, restarts_before)

    def step(
        self, run: Run, state: RemediationState, reason: str, *, new_pid: int | None = None
    ) -> None:
        """Write the transition first; only then is the step taken."""
        rid = run.remediation_id
        self._journal.update_remediation(
            rid, state=state, reason=reason, now_wall_s=self._wall_clock(), new_pid=new_pid
        )
        active = self._active.get(rid)
        if active is not None:
            self._active[rid] = replace(active, state=state, since_wall_s=self._wall_clock())
        self._audit.about(run.trigger, rid, state, state, reason)

    def end(
        self,
        run: Run,
        decision: Decision,
        reason: str,
        *,
        new_pid: int | None = None,
        audited_as: Decision | None = None,
    ) -> RemediationOutcome:
        """Finish the record; `audited_as` when the audit says more than the outcome."""
        rid, trigger, plan = run.remediation_id, run.trigger, run.plan
        self._journal.update_remediation(
            rid,
            state=FINAL_STATE[decision],
            reason=reason,
            now_wall_s=self._wall_clock(),
            new_pid=new_pid,
        )
        self._audit.about(trigger, rid, plan.journal_action, audited_as or decision, reason)
        self._active.pop(rid, None)
        old_pid = self._old_pids.pop(rid, None)
        return RemediationOutcome(
            trigger.instance,
            trigger.incident_id,
            decision,
            reason,
            rid,
            plan.steps,
            old_pid,
            new_pid,
        )

    # -- running -----------------------------------------------------------------------

    async def run_to_end(
        self, run: Run, steps: Callable[[Run], Awaitable[RemediationOutcome]]
    ) -> RemediationOutcome:
        """The steps under the instance's lock; never raises for their failures. The running
        task is kept while they run, so `cancel_all` reaches it however it was started."""
        rid, trigger = run.remediation_id, run.trigger
        task = asyncio.current_task()
        kept = task is not None and task not in self._tasks
        if kept:
            self._tasks.add(task)  # type: ignore[arg-type]  # not None when kept
        try:
            async with self._locks.setdefault(trigger.instance, asyncio.Lock()):
                return await steps(run)
        except asyncio.CancelledError:
            reason = f"{self._prefix(rid)}kvpilot shutting down during {self._state(rid)}"
            self.end(run, Decision.FAILED, reason, audited_as=Decision.INTERRUPTED)
            raise
        except Exception as exc:  # a bug must not leave the record open or kill the tick
            log.exception("remediation %s of %s failed unexpectedly", rid, trigger.instance)
            reason = (
                f"{self._prefix(rid)}internal error during {self._state(rid)}: "
                f"{type(exc).__name__}: {exc}"
            )
            return self.end(run, Decision.FAILED, reason)
        finally:
            self._active.pop(rid, None)
            if kept:
                self._tasks.discard(task)

    def submit(
        self, remediation: Coroutine[Any, Any, RemediationOutcome]
    ) -> asyncio.Task[RemediationOutcome]:
        """Run in the background; the task is kept until it ends."""
        task = asyncio.get_running_loop().create_task(remediation)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait_idle(self) -> None:
        """Until every remediation has ended (but the caller's own, if it runs one)."""
        while others := self._others():
            await asyncio.gather(*others, return_exceptions=True)

    async def cancel_all(self) -> None:
        """Cancel the running remediations (each records itself as interrupted)."""
        for task in self._others():
            task.cancel()
        await self.wait_idle()

    def _others(self) -> list[asyncio.Task[Any]]:
        return [task for task in self._tasks if task is not asyncio.current_task()]

    def _state(self, rid: int) -> RemediationState:
        """How far a remediation got, as its active view says ("planned" without one)."""
        return self._active[rid].state if rid in self._active else "planned"

    def _prefix(self, rid: int) -> str:
        """Whether the server may have been stopped already, said first in the reason."""
        began = self._state(rid) in RESTART_STATES
        return INTERRUPTED_AFTER_RESTART_BEGAN if began else NOT_RESTARTED
