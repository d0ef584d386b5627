"""The sidecar loop. One tick is the ordered list of steps in `Sidecar.steps`, read top to
bottom; each step sees what the steps before it left in the tick's `Round`:

1. observe: the runtime's instances, one NVML reading, every server's sources concurrently;
2. evaluate: the rules turn each server's snapshot (and the runtime's status of it) into
   conditions;
3. commit: the alert tracker advances over them and the pages raised since the last tick;
   transitions, alert rows and notifications are written in one transaction before anything
   acts (`AlertCommit`: a failed commit rolls back, the next tick decides again);
4. deliver: a delivery pass sends what is due (in the background, never two at once);
5. act: remediation observes the rule transitions (restarts run as background tasks); its
   pages and advice become alerts at the next tick's commit;
6. re-tune: the re-tune watch notes a completed tuning run, and checks when due; its alert
   reaches the tracker at the next tick's commit;
7. workload window: the stable server's latest scrape into the learned workload's window;
8. keeper: the learned window saved when due (it outlives a restart of kvpilot);
9. housekeeping: retention hourly; the tuner's figures for `/metrics` from this tick's
   instances; the sidecar's counters, which a scrape reads from memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sqlite3
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from kvpilot.agent.alert_values import AlertTransition
from kvpilot.agent.config import NotifierConfig
from kvpilot.agent.model import Condition, Instance
from kvpilot.agent.notify import DeliveryWorker, Notifier
from kvpilot.agent.remediation import Remediator
from kvpilot.agent.remediation.trigger import RemediationOutcome
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.agent.rules.engine import RuleEngine
from kvpilot.agent.runtimes import Runtime
from kvpilot.agent.runtimes.offloop import runtime_read
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.store import RemediationRecord
from kvpilot.agent.state.trials import SqliteTrialStore
from kvpilot.agent.state.write_failures import WriteFailures
from kvpilot.agent.tasks import GuardedTasks
from kvpilot.agent.tick.after import AfterTick
from kvpilot.agent.tick.alert_commit import AlertCommit
from kvpilot.agent.tick.overruns import TickOverruns
from kvpilot.agent.tick.settings import TickSettings
from kvpilot.agent.tick.tuning_figures import TuningFiguresCache, live_flags
from kvpilot.agent.tick.views import SidecarCounters
from kvpilot.agent.tick.watched import Observed, WatchedServers
from kvpilot.agent.tuning.promoted import running_flags_source
from kvpilot.dashboards import tuning_metrics

log = logging.getLogger(__name__)

RETENTION_EVERY_S = 3600.0


@dataclass(slots=True)
class Round:
    """What one tick's steps hand each other, in the order they fill it."""

    now_s: float
    now_wall_s: float
    instances: list[Instance] = field(default_factory=list)
    observed: list[Observed] = field(default_factory=list)
    conditions: list[Condition] = field(default_factory=list)
    transitions: list[AlertTransition] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TickStep:
    name: str
    run: Callable[[Round], Awaitable[None]]


class Sidecar:
    """The tick's steps over the watched servers, the rules, the alerts and remediation."""

    def __init__(
        self,
        settings: TickSettings,
        *,
        store: StateStore,
        runtime: Runtime,
        remediator: Remediator,
        notifiers: Mapping[str, Notifier],
        watched: WatchedServers,
        alerts: AlertCommit | None = None,
        after: AfterTick | None = None,
        wall_clock: Callable[[], float] = time.time,
        tuning_figures: TuningFiguresCache | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.runtime = runtime
        self.remediator = remediator
        self.watched = watched
        self._after = after or AfterTick()
        self._wall_clock = wall_clock
        self.alerts = alerts or AlertCommit(
            settings, store, wall_clock=wall_clock, write_failures=WriteFailures()
        )
        self.write_failures = self.alerts.write_failures
        self.rules = RuleEngine.from_config(settings.rules)
        self.delivery = DeliveryWorker(store.outbox, notifiers, clock=wall_clock)
        self.tasks = GuardedTasks()
        self.overruns = TickOverruns(settings.interval_s, watched.clock)
        self._tuning = tuning_figures or TuningFiguresCache(SqliteTrialStore(store.db))
        self._delivering: asyncio.Task[None] | None = None
        self._notifications: Counter[tuple[str, str]] = Counter()
        self._remediations: Counter[tuple[str, str]] = Counter()
        self._last_retention_s: float | None = None
        self._counters: SidecarCounters | None = None
        self.ticks_total = 0
        self.last_tick_at_s: float | None = None
        self.steps: tuple[TickStep, ...] = (
            TickStep("observe", self._observe),
            TickStep("evaluate", self._evaluate),
            TickStep("commit", self._commit),
            TickStep("deliver", self._deliver),
            TickStep("act", self._act),
            TickStep("re-tune", self._retune),
            TickStep("workload window", self._workload_window),
            TickStep("keeper", self._keep_window),
            TickStep("housekeeping", self._housekeeping),
        )

    async def tick(self) -> list[AlertTransition]:
        """One tick: every step in order. Returns the alert transitions it committed."""
        now = Round(now_s=self.clock(), now_wall_s=self.now_wall_s())
        for step in self.steps:
            await step.run(now)
        return now.transitions

    # -- the steps, in order -----------------------------------------------------------

    async def _observe(self, now: Round) -> None:
        now.instances = list(await runtime_read(self.runtime, self.runtime.instances))
        now.observed = await self.watched.observe(now.instances, self.tasks)
        now.now_s, now.now_wall_s = self.clock(), self.now_wall_s()

    async def _evaluate(self, now: Round) -> None:
        statuses = await asyncio.gather(
            *(
                runtime_read(self.runtime, self.runtime.status, o.instance.name)
                for o in now.observed
            )
        )
        for seen, status in zip(now.observed, statuses, strict=True):
            why = status.reason or (
                f"exit code {status.exit_code}" if status.exit_code is not None else None
            )
            now.conditions += self.rules.evaluate(
                seen.snapshot,
                instance=seen.instance,
                vllm_window=seen.ticker.vllm_window,
                kvpool_window=seen.ticker.kvpool_window,
                figures=seen.ticker.state.figures,
                instance_state=status.state,
                instance_state_reason=why,
            )

    async def _commit(self, now: Round) -> None:
        retune = self._after.retune
        pages = [*self.remediator.take_events(), *(retune.take_events() if retune else ())]
        now.transitions = self.alerts.advance(now.conditions, pages, now.now_s, now.now_wall_s)

    async def _deliver(self, now: Round) -> None:
        if self._delivering is not None and not self._delivering.done():
            return  # the previous pass still runs (a slow receiver); the next tick retries

        async def deliver() -> None:
            report = await self.delivery.deliver_due()
            for count in report.counts:
                self._notifications[(count.notifier, count.outcome)] += count.items_total

        self._delivering = self.tasks.spawn(deliver(), "delivery")

    async def _act(self, now: Round) -> None:
        rule_transitions = self.alerts.of_rules(now.transitions)
        for task in self.remediator.observe(rule_transitions, now.conditions, now_s=now.now_s):
            self.tasks.watch(task)
            task.add_done_callback(self._count_remediation)

    async def _retune(self, now: Round) -> None:
        self._after.retune_step()

    async def _workload_window(self, now: Round) -> None:
        if self.settings.learn_workload:
            self._after.feed_window(now.instances, self.watched.latest_vllm)

    async def _keep_window(self, now: Round) -> None:
        if self.settings.learn_workload:
            self._after.keep_window()

    async def _housekeeping(self, now: Round) -> None:
        self._retention(now.now_s, now.now_wall_s)
        self._tuning.refresh(now.now_s, live_flags(now.instances, self._flags_source))
        self.ticks_total += 1
        self.last_tick_at_s = now.now_s
        self._counters = self._count()

    # -- start-up, reload and shutdown -------------------------------------------------

    def reconcile(self) -> None:
        """What a previous run left unfinished: remediations failed, the budget restored."""
        for item in self.remediator.reconcile():
            log.warning("reconciled an unfinished remediation: %s", item)

    def use_notifiers(
        self, configs: tuple[NotifierConfig, ...], notifiers: Mapping[str, Notifier]
    ) -> None:
        """A reloaded configuration's notifiers: from now on alerts go to these, and what is
        queued for a notifier of the same name goes to its new settings."""
        self.settings = dataclasses.replace(self.settings, notifiers=configs)
        self.alerts.use_notifiers(configs)
        self.delivery.use_notifiers(notifiers)

    def use_rules(self, rules: RulesConfig) -> None:
        """A reloaded configuration's rules, from the next tick. Their history (stall and
        growth windows) starts again; an alert of a rule turned off resolves as it goes."""
        self.settings = dataclasses.replace(self.settings, rules=rules)
        engine = RuleEngine.from_config(rules)
        engine.errors_total = self.rules.errors_total  # counters go on counting
        self.rules = engine
        self.alerts.use_rules(rules)

    async def aclose(self) -> None:
        """Stop background work: remediations record themselves interrupted; one last delivery."""
        await self.remediator.aclose()
        if self._delivering is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._delivering, timeout=10.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.delivery.deliver_due(), timeout=10.0)
        await self.watched.aclose()

    # -- what the steps keep -----------------------------------------------------------

    def last_actions(self, limit: int) -> list[RemediationRecord]:
        """The latest remediations, newest first (the status API's)."""
        return self.store.remediations(limit=limit)

    def outbox_backlog(self) -> int:
        return self.store.outbox.backlog()

    def clock(self) -> float:
        return self.watched.clock()

    def now_wall_s(self) -> float:
        return self._wall_clock()

    def _count_remediation(self, task: asyncio.Task[RemediationOutcome]) -> None:
        if task.cancelled() or task.exception() is not None:
            return  # a failure is logged and counted by the guard
        outcome = task.result()
        self._remediations[(outcome.instance, outcome.decision)] += 1

    def _retention(self, now_s: float, now_wall_s: float) -> None:
        if (
            self._last_retention_s is not None
            and now_s - self._last_retention_s < RETENTION_EVERY_S
        ):
            return
        self._last_retention_s = now_s
        try:
            report = self.store.apply_retention(self.settings.retention, now_wall_s)
        except sqlite3.Error as exc:  # tried again in an hour
            self.write_failures.failed(exc, "the retention pass", now_s)
            return
        log.info("retention applied: %s", report)

    def counters(self) -> SidecarCounters:
        """The sidecar's own figures as the last tick left them (a scrape reads no database
        and no /proc)."""
        if self._counters is None:
            self._counters = self._count()
        return self._counters

    def _count(self) -> SidecarCounters:
        by_state: Counter[tuple[str, str, str]] = Counter()
        for alert in self.alerts.tracker.alerts():
            labels = dict(alert.labels)
            by_state[(labels.get("alertname", ""), alert.state, labels.get("severity", ""))] += 1
        try:
            backlog: int | None = self.store.outbox.backlog()
        except Exception:  # the gauge goes absent rather than wrong
            log.exception("outbox backlog unreadable")
            backlog = None
        status = self.remediator.status()
        return SidecarCounters(
            alerts_by_state=tuple(sorted(by_state.items())),
            outbox_backlog=backlog,
            notifications_total=tuple(sorted(self._notifications.items())),
            remediations_total=tuple(sorted(self._remediations.items())),
            breakers_open=tuple((b.instance, b.state == "open") for b in status.breakers),
            remediation_in_progress=self.remediator.in_progress(),
            tick_overruns_total=self.overruns.total,
            task_failures_total=tuple(sorted(self.tasks.failures.items())),
            state_write_errors_total=self.write_failures.totals(),
            mode=(status.mode, status.mode_source),
        )

    def tuning_families(self) -> tuple[tuning_metrics.Family, ...]:
        """The tuner's families as the last tick left them: trials read at most every
        `tuning_refresh_s`, each stable server's live flags. Reads nothing (a scrape's path)."""
        return self._tuning.current.families

    def _flags_source(self, instance: Instance) -> tuning_metrics.FlagSource:
        source = running_flags_source(
            self.settings.runtime, self.store, instance.name, instance.argv or ()
        )
        return tuning_metrics.FlagSource(source)
