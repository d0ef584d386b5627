"""Tuning on a schedule inside `kvpilot run`, its restarts through the remediator.

A firing of `tuning.schedule` runs one tuning session beside the collection loop. One that
comes while kvpilot is still starting its servers is deferred until they are up. It is
skipped, with an audit record, while a remediation is planned or running, within the
remediation cooldown of the last restart of the stable instance (a run there would measure a
server still warming up, and could not promote anyway) or while the last run is still going; a
session also stops between trials when a remediation starts. Every restart of the stable
instance (a promotion, a sequential switch, a rollback) goes through the remediator: audited,
dry-run honoured, and for new flags the cooldown, the budget and the circuit breaker too.
Restoring the flags that served before the trial is forced, since it ends the risk rather than
adding one. Under `remediation.dry_run` a firing only plans."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime, timedelta
from typing import Protocol

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger

from kvpilot.agent.mode import Mode, ModeSetting
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.canary_sweep import CanarySweep
from kvpilot.agent.tuning.entry import Recovery, Tuner, run_tuning
from kvpilot.agent.tuning.held import WATCH_EVERY_S, HeldTrials
from kvpilot.agent.tuning.study import Study, StudyError, planned_trials
from kvpilot.agent.tuning.workload.record import remember_workload
from kvpilot.tuner.report.table import summary_line
from kvpilot.tuner.session import TuningBlocked

log = logging.getLogger(__name__)

Audit = Callable[[str, str], None]  # (decision, reason)


class Remediations(Protocol):
    """What scheduled tuning asks of the remediator (`agent.remediation.Remediator`), whose
    restarts of the stable server the tuner's adapter goes through."""

    def in_progress(self) -> bool: ...

    def cooling_down(self, instance: str) -> str | None: ...


async def _nothing() -> None:
    return None


class StaggeredCron(BaseTrigger):  # type: ignore[misc]  # APScheduler ships no types
    """A cron trigger whose every firing comes `offset_s` later."""

    __slots__ = ("cron", "offset")

    def __init__(self, cron: CronTrigger, offset_s: int) -> None:
        self.cron = cron
        self.offset = timedelta(seconds=offset_s)

    def get_next_fire_time(
        self, previous_fire_time: datetime | None, now: datetime
    ) -> datetime | None:
        # The cron's own next time, asked as of `offset` earlier, then moved by `offset`.
        previous = None if previous_fire_time is None else previous_fire_time - self.offset
        fire: datetime | None = self.cron.get_next_fire_time(previous, now - self.offset)
        return None if fire is None else fire + self.offset

    def __str__(self) -> str:
        return f"{self.cron} + {int(self.offset.total_seconds())} s"


class ScheduledTuning:
    """Fires `run_once` on a crontab schedule (UTC), one run at a time, never during a
    remediation; `aclose` cancels a run in progress (its rollout cleans up after itself)."""

    def __init__(
        self,
        schedule: str,
        run_once: Callable[[], Coroutine[object, object, str]],
        *,
        remediation_in_progress: Callable[[], bool],
        audit: Audit,
        recover: Callable[[], Awaitable[object]] | None = None,
        cooling_down: Callable[[], str | None] = lambda: None,
        on_close: Callable[[], None] = lambda: None,
        on_tuned: Callable[[], None] = lambda: None,
        sweep: CanarySweep | None = None,
        held: HeldTrials | None = None,
        offset_s: int = 0,
    ) -> None:
        self.sweep = sweep  # canaries nobody attends, looked for between runs (the pod's)
        self.held = held  # canaries held for review: listed, released, timed out
        # `offset_s`: this Deployment's place in the fleet's window (`stagger_offset_s`).
        self._trigger = StaggeredCron(CronTrigger.from_crontab(schedule, timezone=UTC), offset_s)
        self._run_once = run_once
        self._recover = recover or _nothing
        self._started = False
        self._deferred = False  # a firing came while the servers were starting
        self._remediating = remediation_in_progress
        self._cooling_down = cooling_down
        self._audit = audit
        self._on_close = on_close
        self._task: asyncio.Task[str] | None = None
        self._reopened: str | None = None
        self.on_tuned = on_tuned  # a run completed (the sidecar's re-tune step takes it)
        self.runs_total = 0

    def add_to(self, scheduler: AsyncIOScheduler) -> None:
        scheduler.add_job(
            self.fire,
            self._trigger,
            id="tuning",
            max_instances=1,
            coalesce=True,
            misfire_grace_time=600,
        )
        if self.sweep is not None:
            self.sweep.add_to(scheduler)
        if self.held is not None:
            scheduler.add_job(
                self.held.watch_logged,
                "interval",
                seconds=WATCH_EVERY_S,
                id="tuning-held",
                max_instances=1,
                coalesce=True,
            )

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start_up(self) -> None:
        """Once the servers have started: recover a trial an earlier kvpilot left open, then
        let firings run (one before this would race the recovery and a starting server). A
        firing that came meanwhile runs now, rather than waiting for the next one (a day,
        with a daily schedule)."""
        try:
            await self._recover()
        finally:
            self._started = True
        if self._deferred:
            self._deferred = False
            await self.fire()

    async def fire(self) -> str:
        """One firing: run a session unless something says not now; returns what happened."""
        if not self._started:
            self._deferred = True
            return self._note(
                "deferred", "kvpilot is still starting its servers: the run follows once they are"
            )
        if self.running:
            return self._note("skipped", "the previous tuning run is still going")
        if self._remediating():
            return self._note("skipped", "a remediation is in progress")
        if (cooling := self._cooling_down()) is not None:
            return self._note("skipped", f"the stable instance was restarted recently: {cooling}")
        reopened = self._reopened
        self._audit(
            "started", "scheduled tuning run" + (f", re-opened: {reopened}" if reopened else "")
        )
        self._task = asyncio.create_task(self._run_once(), name="scheduled-tuning")
        self.runs_total += 1
        try:
            stopped = await self._task
        except TuningBlocked as exc:
            return self._note("skipped", str(exc))
        except asyncio.CancelledError:
            self._note("cancelled", "kvpilot is stopping")
            raise
        except Exception as exc:  # a failed run is logged and audited; the next one runs
            log.exception("scheduled tuning run failed")
            return self._note("failed", f"{type(exc).__name__}: {exc}")
        if self._reopened == reopened:
            self._reopened = None
        return self._note("finished", stopped)

    def reopen(self, reason: str) -> None:
        """The ground moved (`agent.tuning.retune`): the next firing re-tunes, and says why."""
        self._reopened = reason

    def next_fire_time(self, now: datetime) -> datetime | None:
        # APScheduler ships no types; a cron trigger returns a datetime, or None when done.
        fire: datetime | None = self._trigger.get_next_fire_time(None, now)
        return fire

    async def aclose(self) -> None:
        """Stop a run in progress; `on_close` first (the pod runtime hands a promotion
        under way over to the next pod instead of undoing it)."""
        task = self._task
        if task is not None and not task.done():
            self._on_close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _note(self, decision: str, reason: str) -> str:
        log.info("scheduled tuning %s: %s", decision, reason)
        self._audit(decision, reason)
        return f"{decision}: {reason}"


def scheduled_tuning(
    tuner: Tuner,
    schedule: str,
    remediations: Remediations,
    store: StateStore,
    *,
    mode: Callable[[], ModeSetting],
    on_tuned: Callable[[], None] = lambda: None,
    sweep: bool = False,
    offset_s: int = 0,
    canary_turn: Callable[[], AbstractAsyncContextManager[None]] = contextlib.nullcontext,
    hold_timeout_s: float | None = None,
) -> ScheduledTuning:
    """The sidecar's scheduled tuning of `tuner`'s stable server: each run studies the server
    as it is then (its vLLM version and the workload a replay sends are part of the study),
    takes the tuner's lease (a firing that finds it held elsewhere is skipped) and recovers
    what an earlier run left open first; in the switch's dry-run mode a firing only plans,
    and while paused it is skipped. `sweep`: canaries nobody attends are looked for
    between runs too (the pod's, whose replicas may be evicted mid-trial). `canary_turn`:
    held around each run (the namespace's cap on canaries: TuningBlocked when full).
    `hold_timeout_s`: canaries held for review are watched and may be released (None: the
    configuration holds none)."""
    name = tuner.name

    def audit(decision: str, reason: str) -> None:
        store.record_audit(
            wall_s=time.time(),
            actor="agent",
            action="tune",
            target=name,
            decision=decision,
            reason=reason,
        )

    def note(done: Recovery) -> None:
        for resumed in done.resumed:
            audit(
                "resumed",
                f"trial {resumed.trial_id} was handed over in {resumed.was.value}: "
                f"{resumed.now.value} ({resumed.reason})",
            )
        for recovered in done.recovered:
            audit(
                "recovered",
                f"trial {recovered.trial_id} was left in {recovered.phase.value}: aborted",
            )
        if done.swept is not None:
            audit("recovered", done.swept)
        for kept in done.kept:
            audit("recovered", kept)

    guard = asyncio.Lock()  # the recovery, a run and a sweep, one at a time

    async def recover() -> None:
        study = await tuner.study()
        async with guard, tuner.lease(wait_s=tuner.start_wait_s):
            note(await tuner.recover(study))

    async def sweep_once() -> None:  # CanarySweep holds the guard
        study = await tuner.study()
        async with tuner.lease():  # held elsewhere: TuningBlocked, this sweep is skipped
            note(await tuner.recover(study))

    async def run_once() -> str:
        try:
            study = await tuner.study()
        except StudyError as exc:
            raise TuningBlocked(f"no study of {name}: {exc}") from exc
        setting = mode()  # the live switch, read as each run starts
        if setting.mode is Mode.PAUSED:
            raise TuningBlocked(f"kvpilot is paused ({setting.describe()})")
        async with guard:
            if setting.mode is Mode.DRY_RUN:
                async with tuner.lease():
                    note(await tuner.recover(study))
                return _plan(study, store)
            replayed = study.choice if study.tuning.canary.traffic == "replay" else None
            if replayed is not None:
                remember_workload(store, replayed, time.time())
            async with canary_turn():  # held: TuningBlocked, the firing is skipped
                summary = await run_tuning(tuner, study, on_recovered=note)
        on_tuned()
        told = f"; {replayed.describe()}" if replayed is not None else ""
        how = f"; {study.strategy_reason}" if study.strategy_reason is not None else ""
        return summary_line(summary) + told + how

    scheduled: ScheduledTuning | None = None
    held = (
        HeldTrials(
            tuner,
            store,
            hold_timeout_s=hold_timeout_s,
            busy=lambda: scheduled is not None and scheduled.running,
            guard=guard,
        )
        if hold_timeout_s is not None
        else None
    )
    scheduled = ScheduledTuning(
        schedule,
        run_once,
        held=held,
        on_tuned=on_tuned,
        remediation_in_progress=remediations.in_progress,
        audit=audit,
        recover=recover,
        cooling_down=lambda: remediations.cooling_down(name),
        on_close=tuner.hand_over,
        offset_s=offset_s,
        sweep=(
            CanarySweep(sweep_once, guard=guard, busy=remediations.in_progress) if sweep else None
        ),
    )
    return scheduled


def _plan(study: Study, store: StateStore) -> str:
    """What a run would try, under remediation.dry_run."""
    told, planned = planned_trials(study, store.db)
    tried = "; ".join(p.candidate.describe() for p in planned)
    return f"dry-run: would try {tried} ({told} past trials told)"
