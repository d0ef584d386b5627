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
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.cron import CronTrigger

from kvpilot.agent.config import AgentConfig
from kvpilot.agent.remediation import Remediator, Trigger
from kvpilot.agent.remediation.ladder import LadderPlan
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime
from kvpilot.agent.runtimes.local import LocalRuntime
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.trials import SqliteTrialStore
from kvpilot.agent.tuning.canary_sweep import CanarySweep
from kvpilot.agent.tuning.factory import local_adapter
from kvpilot.agent.tuning.local_adapter import StableRestarter, recover_at_startup
from kvpilot.agent.tuning.pod_tuner import PodRecovery, PodTuner
from kvpilot.agent.tuning.study import (
    Study,
    StudyError,
    build_study,
    make_session,
    read_gpu,
    stable_instance,
)
from kvpilot.agent.tuning.workload.choice import WorkloadChoice
from kvpilot.agent.tuning.workload.record import remember_workload
from kvpilot.tuner.ports import RestartRefused
from kvpilot.tuner.render import summary_line
from kvpilot.tuner.session import TuningBlocked, dry_run
from kvpilot.tuner.suggest import BayesianSuggester

log = logging.getLogger(__name__)

Audit = Callable[[str, str], None]  # (decision, reason)


async def _nothing() -> None:
    return None


def remediated_restarter(remediator: Remediator, instance: str) -> StableRestarter:
    """The tuner's stable restarts as remediations of `instance` (rule `tuning`)."""

    async def restart(argv: tuple[str, ...], reason: str, restore: bool) -> None:
        trigger = Trigger(
            instance=instance,
            rule="tuning",
            fingerprint=None,
            incident_id=f"tuning-{uuid.uuid4().hex[:12]}",
            actor="agent",
            requested_by="tuner",
            force=restore,
        )
        plan = LadderPlan(
            rule="tuning", action="promote", steps=("promote",), reason=reason, argv=argv
        )
        outcome = await remediator.remediate(trigger, plan)
        if outcome.decision == "succeeded":
            return
        if outcome.decision == "failed":
            raise RuntimeFailure(outcome.reason)
        raise RestartRefused(outcome.reason)  # skipped by a guard, vetoed, dry-run

    return restart


class ScheduledTuning:
    """Fires `run_once` on a crontab schedule (UTC), one run at a time, never during a
    remediation; `aclose` cancels a run in progress (its rollout cleans up after itself)."""

    sweep: CanarySweep | None = None  # the pod runtime's, for canaries nobody attends

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
    ) -> None:
        self._trigger = CronTrigger.from_crontab(schedule, timezone=UTC)
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
        return self._trigger.get_next_fire_time(None, now)

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
    config: AgentConfig,
    config_sha256: str,
    runtime: LocalRuntime,
    remediator: Remediator,
    store: StateStore,
    *,
    api_key: str | None = None,
    vllm_version: Callable[[], str | None] = lambda: None,
    workload: Callable[[], WorkloadChoice | None] = lambda: None,
    on_tuned: Callable[[], None] = lambda: None,
) -> ScheduledTuning:
    """The sidecar's scheduled tuning of its stable instance (config.tuning.schedule set);
    `vllm_version`: the stable server's, read at each run into the study's fingerprint;
    `workload`: what each run replays (the learned workload once its window is full)."""
    tuning = config.tuning
    assert tuning.schedule is not None
    study = build_study(config, tuning, read_gpu(_pids(runtime, stable_instance(config).name)))
    name = study.stable.name
    adapter = local_adapter(
        config,
        runtime,
        store.db,
        config_sha256=config_sha256,
        tuning=tuning,
        remediation_in_progress=remediator.in_progress,
        restart_stable=remediated_restarter(remediator, name),
    )

    async def recover() -> None:
        for done in await recover_at_startup(store.db, adapter):
            audit("recovered", f"trial {done.trial_id} was left in {done.phase.value}: aborted")

    async def run_once() -> str:
        await recover()  # a trial an earlier kvpilot left open
        version = vllm_version()  # known once the server answered /version
        chosen = workload()
        now = (
            study
            if version is None and chosen is None
            else build_study(
                config, tuning, read_gpu(_pids(runtime, name)), vllm_version=version, chosen=chosen
            )
        )
        if remediator.config.dry_run:
            return _plan(now, store)
        if now.choice is not None:
            remember_workload(store, now.choice, time.time())
        session = make_session(now, adapter, store.db, api_key=api_key)
        summary = await session.run(tuning.trials)
        scheduled.on_tuned()
        told = f"; {chosen.describe()}" if chosen is not None else ""
        how = f"; {now.strategy_reason}" if now.strategy_reason is not None else ""
        return summary_line(summary) + told + how

    def audit(decision: str, reason: str) -> None:
        store.record_audit(
            wall_s=time.time(),
            actor="agent",
            action="tune",
            target=name,
            decision=decision,
            reason=reason,
        )

    scheduled = ScheduledTuning(
        tuning.schedule,
        run_once,
        on_tuned=on_tuned,
        remediation_in_progress=remediator.in_progress,
        audit=audit,
        recover=recover,
        cooling_down=lambda: remediator.cooling_down(name),
    )
    return scheduled


def _plan(study: Study, store: StateStore) -> str:
    """What a run would try, under remediation.dry_run."""
    tuning = study.tuning
    told, planned = dry_run(
        study.space,
        BayesianSuggester(study.space, seed=tuning.seed),
        SqliteTrialStore(store.db),
        study.fingerprint,
        tuning.trials,
        initial_points=len(study.space.knobs) + 2,
    )
    tried = "; ".join(p.candidate.describe() for p in planned)
    return f"dry-run: would try {tried} ({told} past trials told)"


def pod_scheduled_tuning(
    config: AgentConfig,
    runtime: KubernetesRuntime,
    remediator: Remediator,
    store: StateStore,
    *,
    api_key: str | None = None,
    vllm_version: Callable[[], str | None] = lambda: None,
    workload: Callable[[], WorkloadChoice | None] = lambda: None,
    on_tuned: Callable[[], None] = lambda: None,
) -> ScheduledTuning:
    """The pod's scheduled tuning: canary Deployments, promotion by patching the Deployment,
    one tuner per Deployment through its Lease (a firing that finds it held is skipped). The
    study is read from the Deployment's live flags at each run; a replay sends `workload`
    (the learned one once its window is full), live traffic is its own workload."""
    tuning = config.tuning
    assert tuning.schedule is not None
    name = runtime.target.stable_name
    tuner = PodTuner(
        config, runtime, store.db, remediation_in_progress=remediator.in_progress, api_key=api_key
    )
    tuner.vllm_version = vllm_version  # into the study's fingerprint
    tuner.workload = workload

    def audit(decision: str, reason: str) -> None:
        store.record_audit(
            wall_s=time.time(),
            actor="agent",
            action="tune",
            target=name,
            decision=decision,
            reason=reason,
        )

    def note(done: PodRecovery) -> None:
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

    guard = asyncio.Lock()  # the recovery, a run and a sweep of this pod, one at a time

    async def recover() -> None:
        study = await tuner.study()
        # A pod that starts while the one it replaces still holds the Lease waits it out.
        async with guard, tuner.lease(wait_s=2.0 * runtime.lease.duration_s):
            note(await tuner.recover(study))

    async def sweep() -> None:  # CanarySweep holds the guard
        study = await tuner.study()
        async with tuner.lease():  # held elsewhere: TuningBlocked, this sweep is skipped
            note(await tuner.recover(study))

    async def run_once() -> str:
        try:
            study = await tuner.study()
        except StudyError as exc:
            raise TuningBlocked(f"no study of the Deployment: {exc}") from exc
        async with guard, tuner.lease():
            note(await tuner.recover(study))
            if remediator.config.dry_run:
                return _plan(study, store)
            replayed = study.choice if tuning.canary.traffic == "replay" else None
            if replayed is not None:
                remember_workload(store, replayed, time.time())
            summary = await tuner.session(study).run(tuning.trials)
        scheduled.on_tuned()
        return summary_line(summary) + (f"; {replayed.describe()}" if replayed else "")

    scheduled = ScheduledTuning(
        tuning.schedule,
        run_once,
        on_tuned=on_tuned,
        remediation_in_progress=remediator.in_progress,
        audit=audit,
        recover=recover,
        cooling_down=lambda: remediator.cooling_down(name),
        on_close=tuner.hand_over,
    )
    scheduled.sweep = CanarySweep(sweep, guard=guard, busy=remediator.in_progress)
    return scheduled


def _pids(runtime: LocalRuntime, name: str) -> frozenset[int]:
    """The stable server's processes, whose GPU memory the search may count as room."""
    return frozenset(pid for i in runtime.instances() if i.name == name for pid in i.pids)
