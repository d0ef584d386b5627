"""The sidecar loop: every tick, read each server, evaluate the rules, track alerts, notify
through the outbox, and hand firing alerts to remediation.

One tick, in order (each step sees the same snapshot):

1. one NVML reading, then every server's sources concurrently (`Ticker`);
2. the rules turn each server's snapshot into conditions (`RuleEngine`);
3. the alert tracker advances the lifecycle; transitions and alert rows are written to the
   state store, notifications into the outbox, in one transaction, before anything acts;
   when it cannot commit (a full disk) the tracker goes back to where it was, nothing acts,
   and the next tick decides again: what memory holds as sent is what the disk holds;
4. remediation observes the transitions (restarts run as background tasks); the pages and
   advice it raises become alerts of the tracker on the next tick, so silences apply to
   them and the API lists them like any rule's;
5. a delivery pass sends what is due (in the background, never two at once);
6. the tuner's figures for `/metrics` are refreshed from this tick's instances and, at most
   every `tuning_refresh_s`, the trial store: a scrape reads them from memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import httpx

from kvpilot.agent.alerts import AlertTracker, AlertTransition
from kvpilot.agent.config import AgentConfig, NotifierConfig
from kvpilot.agent.model import AlertEvent, Condition, Instance, Labels
from kvpilot.agent.notify import DeliveryWorker, Notifier
from kvpilot.agent.readings.snapshot import NvmlReading, read_nvml
from kvpilot.agent.remediation import Remediator
from kvpilot.agent.remediation.remediator import RemediationOutcome
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.agent.rules.engine import RuleEngine
from kvpilot.agent.runtimes import Runtime
from kvpilot.agent.runtimes.offloop import runtime_read
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.trials import SqliteTrialStore
from kvpilot.agent.state.write_failures import WriteFailures
from kvpilot.agent.tasks import GuardedTasks
from kvpilot.agent.tick.calibration import model_config_of
from kvpilot.agent.tick.external_labels import outgoing
from kvpilot.agent.tick.overruns import TickOverruns
from kvpilot.agent.tick.pages import RemediationPages
from kvpilot.agent.tick.ticker import Ticker
from kvpilot.agent.tick.tuning_figures import (
    DEFAULT_TUNING_REFRESH_S,
    TuningFiguresCache,
    live_flags,
)
from kvpilot.agent.tick.views import ServerView, SidecarCounters
from kvpilot.agent.tick.wiring import CollectSettings, build_ticker, scrape_limits
from kvpilot.agent.tuning.promoted import running_flags_source
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import NvmlSnapshot
from kvpilot.collectors.nvml import NvmlCollector
from kvpilot.collectors.vllm_metrics import VllmScrape
from kvpilot.dashboards import tuning_metrics
from kvpilot.tuner.trials import TrialStore

log = logging.getLogger(__name__)

RETENTION_EVERY_S = 3600.0


class Sidecar:
    """Owns the per-server tickers, the alert tracker, the outbox and the remediator."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        store: StateStore,
        runtime: Runtime,
        notifiers: Mapping[str, Notifier],
        remediator: Remediator,
        client: httpx.AsyncClient,
        nvml: NvmlCollector,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        trial_store: TrialStore | None = None,
        tuning_refresh_s: float = DEFAULT_TUNING_REFRESH_S,
    ) -> None:
        self.config = config
        self.store = store
        self.runtime = runtime
        self.remediator = remediator
        self._client = client
        self._server_clients: dict[str, httpx.AsyncClient] = {}
        self._tls = httpx.create_ssl_context()  # loaded once, shared by the servers' clients
        self._nvml = nvml
        self._clock = clock
        self._wall_clock = wall_clock
        self._notifier_configs = {n.name: n for n in config.notifiers}
        self.delivery = DeliveryWorker(store.outbox, notifiers, clock=wall_clock)
        self.rules = RuleEngine.from_config(config.rules)
        self.tracker = self._restore_tracker()
        self._pages = RemediationPages.restore(self.tracker.alerts())
        self._tickers: dict[str, Ticker] = {}
        self._roles: dict[str, str] = {}
        self._pids: dict[str, frozenset[int]] = {}
        self._delivering: asyncio.Task[None] | None = None
        self.tasks = GuardedTasks()
        self._counters: SidecarCounters | None = None
        self.overruns = TickOverruns(config.interval_s, clock)
        self._latest_nvml: NvmlSnapshot | SourceError | None = None
        self._last_retention_s: float | None = None
        self._last_repeat_wall_s: dict[tuple[str, str], float] = {}
        self._unsaved_events: list[AlertEvent] = []  # pages of a tick whose commit failed
        self.event_sources: list[Callable[[], list[AlertEvent]]] = []  # more pages (re-tune)
        self.write_failures = WriteFailures()
        self._notifications: Counter[tuple[str, str]] = Counter()
        self._remediations: Counter[tuple[str, str]] = Counter()
        self.ticks_total = 0
        self.last_tick_at_s: float | None = None
        self._tuning = TuningFiguresCache(
            trial_store if trial_store is not None else SqliteTrialStore(store.db),
            refresh_s=tuning_refresh_s,
        )

    # -- start-up ----------------------------------------------------------------------

    def _restore_tracker(self) -> AlertTracker:
        repeat_s = min((n.repeat_interval_s for n in self.config.notifiers), default=4 * 3600.0)
        api = self.config.api_listen()
        external = f"http://{api.host}:{api.port}/api/v1/alerts"
        rows = self.store.load_alerts()
        silences = self.store.load_silences(self._wall_clock())
        return AlertTracker.from_rows(
            rows,
            self.config.rules.for_s_by_rule(),
            silences=silences,
            repeat_interval_s=repeat_s,
            generator_url=external,
        )

    def use_notifiers(
        self, configs: tuple[NotifierConfig, ...], notifiers: Mapping[str, Notifier]
    ) -> None:
        """A reloaded configuration's notifiers: from now on alerts go to these, and what is
        queued for a notifier of the same name goes to its new settings."""
        self.config = self.config.model_copy(update={"notifiers": configs})
        self._notifier_configs = {n.name: n for n in configs}
        self.tracker.repeat_interval_s = min(
            (n.repeat_interval_s for n in configs), default=4 * 3600.0
        )
        self.delivery.use_notifiers(notifiers)

    def use_rules(self, rules: RulesConfig) -> None:
        """A reloaded configuration's rules, from the next tick. Their history (stall and
        growth windows) starts again; an alert of a rule turned off resolves as it goes."""
        self.config = self.config.model_copy(update={"rules": rules})
        engine = RuleEngine.from_config(rules)
        engine.errors_total = self.rules.errors_total  # counters go on counting
        self.rules = engine
        self.tracker.use_for_s(rules.for_s_by_rule())

    def reconcile(self) -> None:
        """What a previous run left unfinished: remediations failed, the budget restored."""
        for item in self.remediator.reconcile():
            log.warning("reconciled an unfinished remediation: %s", item)

    # -- the tick ----------------------------------------------------------------------

    async def tick(self) -> list[AlertTransition]:
        instances = await runtime_read(self.runtime, self.runtime.instances)
        self._forget_gone({i.name for i in instances})
        nvml = await read_nvml(self._nvml, self._clock)
        self._latest_nvml = nvml.value
        per_server = await asyncio.gather(*(self._server(i, nvml) for i in instances))
        conditions = [c for server in per_server for c in server]
        now_s, now_wall_s = self._clock(), self._wall_clock()
        events = [
            *self._unsaved_events,
            *self.remediator.take_events(),
            *(e for source in self.event_sources for e in source()),
        ]
        before = self.tracker.checkpoint()
        transitions = self.tracker.update(
            [*conditions, *self._pages.conditions(events)], now_s, now_wall_s
        )
        if self._commit(transitions, now_s, now_wall_s):
            self._unsaved_events = []
        else:  # memory follows the disk: the next tick decides, and notifies, again
            self.tracker.rollback(before)
            self._unsaved_events = events
            transitions = []
        rule_transitions = [t for t in transitions if not self._pages.owns(t.rule)]
        for task in self.remediator.observe(rule_transitions, conditions, now_s=now_s):
            self.tasks.watch(task)
            task.add_done_callback(self._count_remediation)
        self._deliver_in_background()
        self._retention(now_s, now_wall_s)
        self._refresh_tuning(instances, now_s)
        self.ticks_total += 1
        self.last_tick_at_s = now_s
        self._counters = self._count()
        return transitions

    def clock(self) -> float:
        return self._clock()

    def now_wall_s(self) -> float:
        return self._wall_clock()

    async def _server(self, instance: Instance, nvml: NvmlReading) -> list[Condition]:
        ticker = self._ticker(instance)
        self._roles[instance.name] = instance.role
        self._pids[instance.name] = instance.pids
        snapshot = await ticker.tick(nvml)
        status = await runtime_read(self.runtime, self.runtime.status, instance.name)
        why = status.reason or (
            f"exit code {status.exit_code}" if status.exit_code is not None else None
        )
        return self.rules.evaluate(
            snapshot,
            instance=instance,
            vllm_window=ticker.vllm_window,
            kvpool_window=ticker.kvpool_window,
            figures=ticker.state.figures,
            instance_state=status.state,
            instance_state_reason=why,
        )

    def _forget_gone(self, names: set[str]) -> None:
        """A server the runtime no longer lists (a canary removed): its series go too."""
        for name in set(self._tickers) - names:
            del self._tickers[name]
            self._roles.pop(name, None)
            self._pids.pop(name, None)
            client = self._server_clients.pop(name, None)
            if client is not None:
                self.tasks.spawn(client.aclose(), f"close-client-{name}")

    def _ticker(self, instance: Instance) -> Ticker:
        ticker = self._tickers.get(instance.name)
        if ticker is None:
            api_key = self.config.runtime.api_key
            settings = CollectSettings(
                vllm_url=instance.url,
                kvpool_url=instance.kvpool_url,
                api_key=api_key.get_secret_value() if api_key else None,
                limits=scrape_limits(self.config),
                model_config=instance.model_config or model_config_of(instance.argv),
            )
            # A client per server: one pool's connection scan grows with every server
            # watched, and that cost is paid on every request of every server.
            client = httpx.AsyncClient(timeout=self._client.timeout, verify=self._tls)
            self._server_clients[instance.name] = client
            ticker = build_ticker(settings, client)
            self._tickers[instance.name] = ticker
        return ticker

    # -- alerts into the outbox --------------------------------------------------------

    def _commit(self, transitions: list[AlertTransition], now_s: float, now_wall_s: float) -> bool:
        """Transitions, outbox rows and alert states in one transaction. Memory takes its
        share (repeat marks, log lines) only once it committed: False when it did not (a full
        disk, a read-only file), said by `write_failures` and retried by the next tick."""
        sent: dict[tuple[str, str], float] = {}
        try:
            with self.store.transaction():
                for transition in transitions:
                    self._record(transition, now_wall_s, sent)
                self.store.save_alerts(self.tracker.to_rows())
        except sqlite3.Error as exc:
            self.write_failures.failed(exc, "the alert changes of a tick", now_s)
            return False
        self.write_failures.succeeded(now_s)
        self._last_repeat_wall_s.update(sent)
        for transition in transitions:
            _log_transition(transition)
        return True

    def _record(
        self, transition: AlertTransition, now_wall_s: float, sent: dict[tuple[str, str], float]
    ) -> None:
        labels = dict(transition.labels)
        if _audited(transition):
            self.store.record_audit(
                wall_s=now_wall_s,
                actor="rule",
                action="alert",
                target=labels.get("instance", ""),
                decision=transition.to_state,
                reason=transition.reason or labels.get("alertname", transition.rule),
                incident_id=transition.incident_id,
                details={"fingerprint": transition.fingerprint, "labels": labels},
            )
        if transition.event is not None and not transition.silenced:
            self._enqueue_all(transition.event, now_wall_s, sent, repeat=transition.repeat)

    def _enqueue_all(
        self,
        event: AlertEvent,
        now_wall_s: float,
        sent: dict[tuple[str, str], float],
        *,
        repeat: bool,
    ) -> None:
        """Outbox rows for the notifiers that want `event`; `sent` collects the repeat marks
        that hold once the transaction commits. What leaves carries the replica's labels."""
        leaving = outgoing(event, self.config.rules.external_labels)
        for name, cfg in self._notifier_configs.items():
            if not self._wants(cfg, event, now_wall_s, repeat=repeat):
                continue
            self.store.outbox.enqueue(name, leaving, now_wall_s)
            sent[(name, event.fingerprint)] = now_wall_s

    def _wants(
        self, cfg: NotifierConfig, event: AlertEvent, now_wall_s: float, *, repeat: bool
    ) -> bool:
        if event.status == "resolved":
            return cfg.send_resolved
        if not repeat:
            return True
        # The tracker repeats at the shortest interval; each notifier keeps its own.
        last = self._last_repeat_wall_s.get((cfg.name, event.fingerprint))
        return last is None or now_wall_s - last >= cfg.repeat_interval_s

    # -- background work ---------------------------------------------------------------

    def _deliver_in_background(self) -> None:
        if self._delivering is not None and not self._delivering.done():
            return  # the previous pass still runs (a slow receiver); the next tick retries

        async def deliver() -> None:
            report = await self.delivery.deliver_due()
            for count in report.counts:
                self._notifications[(count.notifier, count.outcome)] += count.items_total

        self._delivering = self.tasks.spawn(deliver(), "delivery")

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
            report = self.store.apply_retention(self.config.retention, now_wall_s)
        except sqlite3.Error as exc:  # tried again in an hour
            self.write_failures.failed(exc, "the retention pass", now_s)
            return
        log.info("retention applied: %s", report)

    async def aclose(self) -> None:
        """Stop background work: remediations record themselves interrupted; one last delivery."""
        await self.remediator.aclose()
        if self._delivering is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._delivering, timeout=10.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.delivery.deliver_due(), timeout=10.0)
        for client in self._server_clients.values():
            await client.aclose()
        self._server_clients.clear()

    # -- views -------------------------------------------------------------------------

    def servers(self) -> list[ServerView]:
        return [
            ServerView(
                name,
                self._roles.get(name, "stable"),
                ticker.state,
                self._pids.get(name, frozenset()),
            )
            for name, ticker in self._tickers.items()
        ]

    def counters(self) -> SidecarCounters:
        """The sidecar's own figures as the last tick left them (a scrape reads no database
        and no /proc)."""
        if self._counters is None:
            self._counters = self._count()
        return self._counters

    def _count(self) -> SidecarCounters:
        by_state: Counter[tuple[str, str, str]] = Counter()
        for alert in self.tracker.alerts():
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
        )

    def tuning_families(self) -> tuple[tuning_metrics.Family, ...]:
        """The tuner's families as the last tick left them: trials read at most every
        `tuning_refresh_s`, each stable server's live flags. Reads nothing (a scrape's path)."""
        return self._tuning.current.families

    def _refresh_tuning(self, instances: Sequence[Instance], now_s: float) -> None:
        self._tuning.refresh(now_s, live_flags(instances, self._flags_source))

    def _flags_source(self, instance: Instance) -> tuning_metrics.FlagSource:
        source = running_flags_source(self.config, self.store, instance.name, instance.argv or ())
        return tuning_metrics.FlagSource(source)

    def latest_nvml(self) -> NvmlSnapshot | SourceError | None:
        return self._latest_nvml

    def cache_config(self, name: str) -> Labels | None:
        """The server's `vllm:cache_config_info` labels, for the memory pre-flight."""
        scrape = self.latest_vllm(name)
        return scrape.engines[0].cache_config if scrape and scrape.engines else None

    def latest_vllm(self, name: str) -> VllmScrape | None:
        ticker = self._tickers.get(name)
        latest = ticker.state.latest if ticker else None
        return latest.vllm if latest and isinstance(latest.vllm, VllmScrape) else None


def _audited(transition: AlertTransition) -> bool:
    """A firing or resolved alert (not a repeat) goes into the audit log and the agent's log."""
    return transition.to_state in ("firing", "resolved") and not transition.repeat


def _log_transition(transition: AlertTransition) -> None:
    if not _audited(transition):
        return
    labels = dict(transition.labels)
    ids = {"incident_id": transition.incident_id, "fingerprint": transition.fingerprint}
    log.info(
        "alert %s %s on %s",
        labels.get("alertname"),
        transition.to_state,
        labels.get("instance"),
        extra=ids,
    )
