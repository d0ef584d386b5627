"""A person's review of held canaries (`tuning.hold_inconclusive`), as Argo Rollouts' `promote`
and `abort`: the held trials listed, one released (promoted the way a judge's pass is, or
rolled back), every release audited, and a hold that outlives `tuning.hold_timeout_s` rolled
back, saying so. A release runs a session of the tuner (its runtime, its restart guards, its
observer for the bake) under the tuner's lease, never beside a tuning run."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from kvpilot.agent.state.store import StateStore
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.agent.tuning.entry import Tuner
from kvpilot.agent.tuning.study import StudyError
from kvpilot.tuner.rollout.canary import NotHeld, Phase, Release, RolloutRecord, held_records
from kvpilot.tuner.session import TuningBlocked

log = logging.getLogger(__name__)
WATCH_EVERY_S = 60.0  # a hold past its timeout is rolled back within this much more


class ReleaseRefused(RuntimeError):
    """The release cannot happen now or ever; `status` is the HTTP answer that says so."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class HeldTrial:
    """One held trial as a person reviews it (the argv as the journal keeps it: masked)."""

    trial_id: str
    number: int | None
    values: dict[str, object]
    candidate_argv: tuple[str, ...]
    held_since_wall_s: float
    rolled_back_at_wall_s: float  # the hold's timeout
    reason: str | None


@dataclass(frozen=True, slots=True)
class Released:
    """Where a release left its trial; `changed` False: a repeat, answered as it stands."""

    trial_id: str
    action: Release
    phase: Phase
    reason: str | None
    changed: bool


class HeldTrials:
    """The held trials of one tuner's journal, and their release. `busy`: a tuning run is
    under way; `guard`: the schedule's lock over its recovery, runs and sweeps. A release is
    refused while either is taken (a run's recovery would take a release's open record for
    an interrupted trial) and holds the guard itself, so a firing waits for it."""

    def __init__(
        self,
        tuner: Tuner,
        store: StateStore,
        *,
        hold_timeout_s: float,
        busy: Callable[[], bool] = lambda: False,
        guard: asyncio.Lock | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._tuner = tuner
        self._store = store
        self._journal = SqliteRolloutJournal(store.db)
        self._trials = SqliteTrialStore(store.db)
        self._timeout_s = hold_timeout_s
        self._busy = busy
        self._wall = wall_clock
        self._lock = asyncio.Lock()  # one release at a time
        # The schedule's: its recovery, runs and sweeps; a release holds it too, so that a
        # firing waits for the release instead of recovering its open record.
        self._guard = guard or asyncio.Lock()
        self._noted: set[str] = set()  # held trials already audited by this process

    def held(self) -> list[HeldTrial]:
        """The trials held for review, oldest first."""
        listed = []
        for record in held_records(self._journal):
            trial = self._trials.get(record.trial_id)
            listed.append(
                HeldTrial(
                    record.trial_id,
                    None if trial is None else trial.number,
                    {} if trial is None else dict(trial.values),
                    record.candidate_argv,
                    record.updated_wall_s,
                    record.updated_wall_s + self._timeout_s,
                    record.reason,
                )
            )
        return listed

    def check(self, trial_id: str, action: Release) -> Released | None:
        """What a release of `trial_id` would meet: None (it may go ahead), a repeat's
        answer, or ReleaseRefused (404: unknown; 409: not held, or a run under way)."""
        record = self._journal.get(trial_id)
        if record is None:
            raise ReleaseRefused(f"no trial {trial_id!r}", 404)
        if record.phase is not Phase.HELD:
            if record.released_as() is action:
                return _released(record, action, changed=False)
            raise ReleaseRefused(str(NotHeld(record)), 409)
        if self._busy() or self._lock.locked() or self._guard.locked():
            raise ReleaseRefused("a tuning run or another release is under way; try again", 409)
        return None

    async def release(self, trial_id: str, action: Release, *, by: str, reason: str) -> Released:
        """Promote or roll back the held `trial_id`, audited before and after; a repeat of
        a release that already ended is answered as it stands (changed False)."""
        async with self._lock:
            record = self._journal.get(trial_id)
            if record is None:
                raise ReleaseRefused(f"no trial {trial_id!r}", 404)
            if record.phase is not Phase.HELD:
                if record.released_as() is action:
                    return _released(record, action, changed=False)
                raise ReleaseRefused(str(NotHeld(record)), 409)
            if self._busy() or self._guard.locked():
                raise ReleaseRefused("a tuning run is under way; try again once it ends", 409)
            self._audit(trial_id, f"{action.value}-requested", f"{action.words} by {by}: {reason}")
            try:
                async with self._guard, self._tuner.lease():
                    study = await self._tuner.study()
                    outcome = await self._tuner.session(study).release(
                        trial_id, action, by=by, reason=reason
                    )
            except (StudyError, TuningBlocked) as exc:
                self._audit(trial_id, "release-failed", str(exc))
                raise ReleaseRefused(f"not released now: {exc}", 503) from exc
            except Exception as exc:
                self._audit(trial_id, "release-failed", f"{type(exc).__name__}: {exc}")
                raise
            done = outcome.record
            self._audit(trial_id, done.phase.value, done.reason or done.phase.value)
            return _released(done, action, changed=True)

    async def watch(self) -> list[Released]:
        """One look: each newly held trial audited (until when it waits), and each hold past
        its timeout rolled back. Returns the rollbacks."""
        now = self._wall()
        expired = []
        for held in self.held():
            if held.trial_id not in self._noted:
                self._noted.add(held.trial_id)
                until = datetime.fromtimestamp(held.rolled_back_at_wall_s, UTC).isoformat()
                why = (
                    f"trial {held.number} is held for review until {until}: "
                    f"kvpilot tuning release {held.trial_id} --promote|--rollback"
                )
                log.warning("%s", why)
                self._audit(held.trial_id, "held", why)
            if held.rolled_back_at_wall_s <= now:
                expired.append(held.trial_id)
        done = []
        for trial_id in expired:
            why = f"no review within the hold's {self._timeout_s:g} s (tuning.hold_timeout_s)"
            try:
                done.append(
                    await self.release(trial_id, Release.ROLLBACK, by="kvpilot", reason=why)
                )
            except ReleaseRefused as exc:  # a run under way, or the runtime: the next look
                log.warning("the expired hold of trial %s stays for now: %s", trial_id, exc)
        return done

    async def watch_logged(self) -> None:
        """`watch` for a scheduler's interval job (every WATCH_EVERY_S): never raises."""
        try:
            await self.watch()
        except Exception:  # logged; the next look tries again
            log.exception("the look at held canaries failed")

    def _audit(self, trial_id: str, decision: str, reason: str) -> None:
        self._store.record_audit(
            wall_s=self._wall(),
            actor="agent",
            action="tuning-hold",
            target=trial_id,
            decision=decision,
            reason=reason,
        )


def _released(record: RolloutRecord, action: Release, *, changed: bool) -> Released:
    return Released(record.trial_id, action, record.phase, record.reason, changed)
