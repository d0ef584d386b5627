"""When `kvpilot run` re-opens tuning: the ground moved, or preemptions keep coming.

A tuned configuration was chosen on some ground (`agent.tuning.ground`): a vLLM version, a
model, a coarse workload shape. When one of them moves, the trials that chose it measured
another server. Preemption incidents that keep coming (`tuning.retune.preemption_incidents`
VllmPreemptionSpike firings within `within_h` hours, counted since the last tuning run) while
the tuner holds no validated better configuration (`agent.tuning.best`: judged pass,
promoted, and not what runs already) say the same from the other side.

Re-opened tuning goes to the schedule where `tuning.schedule` is set (the next firing tunes,
and says why); otherwise a KvpilotTuningRecommended alert (label rule=retune) says why. It
resolves once a tuning run completed on the ground that moved, or the ground is back; while
the part that moved is unknown again (no `/version` read) it stays open, since unknown is not
healthy. Each change is decided and audited once, not at every check. Missing data (no
version yet, no workload window, no tuning run recorded) is no verdict, with the reason.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from kvpilot.agent.alert_values import AlertView
from kvpilot.agent.config.tuning import RetuneConfig
from kvpilot.agent.model import AlertEvent, Instance, fingerprint, labels_of
from kvpilot.agent.remediation.events import TUNING_RECOMMENDED_ALERT, resolved
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.ground import (
    Ground,
    GroundStore,
    TunedGround,
    argv_model,
    moved,
    moved_parts,
    unknown_parts,
)
from kvpilot.collectors.vllm_metrics import VllmScrape

log = logging.getLogger(__name__)

RETUNE_RULE = "retune"  # the alert's `rule` label: tells it from the remediator's advice
PREEMPTION = "preemption"  # the part a preemption reason stands on
PREEMPTION_ALERT = "VllmPreemptionSpike"
# Its name before the engine alerts took the `Vllm` prefix: firings audited then count too.
PREEMPTION_ALERT_BEFORE = "PreemptionSpike"
PARTS_ANNOTATION = "retune_parts"
DEFAULT_CHECK_EVERY_S = 60.0

# The coarse workload shape's key (`tuner.load.learned.coarse_key` of the learned window's
# shape), or None while there is too little traffic to say.
WorkloadKey = Callable[[], str | None]
Better = Callable[[str], "tuple[str, ...] | None"]  # agent.remediation.ladder.BetterConfig


class Reopenable(Protocol):
    """Scheduled tuning, as the re-tune decision sees it (`ScheduledTuning`)."""

    def reopen(self, reason: str) -> None: ...

    def next_fire_time(self, now: datetime) -> datetime | None: ...


@dataclass(frozen=True, slots=True)
class RetuneVerdict:
    """One check of one instance. `reopen`: why tuning re-opens (empty: it does not);
    `parts`: what those reasons stand on; `unknown`: what could not be judged, and why."""

    instance: str
    reopen: tuple[str, ...]
    parts: tuple[str, ...]
    unknown: tuple[str, ...]
    unknown_parts: tuple[str, ...]

    @property
    def decision(self) -> str:
        if self.reopen:
            return "reopened"
        return "no verdict" if self.unknown else "settled"


def decide(
    instance: str,
    tuned: TunedGround | None,
    current: Ground,
    incidents: int | None,
    settings: RetuneConfig,
    no_better: Callable[[], str | None],
) -> RetuneVerdict:
    """The verdict on `instance` now. `incidents`: VllmPreemptionSpike firings in the window
    (None: unreadable); `no_better` says why no validated better configuration exists, or
    None when one does (asked only when the incidents reach the threshold)."""
    reopen: list[str] = []
    parts: list[str] = []
    unknown: list[str] = []
    unknown_of: list[str] = []
    if tuned is None:
        unknown.append("no tuning run recorded yet: no ground to compare with")
        unknown_of.extend(("vllm_version", "model", "workload_key"))
    else:
        reopen.extend(moved(tuned.ground, current))
        parts.extend(moved_parts(tuned.ground, current))
        for part in unknown_parts(tuned.ground, current):
            unknown_of.append(part)
            unknown.append(_unknown(part, tuned.ground, current))
    if incidents is None:
        unknown.append("the VllmPreemptionSpike incidents could not be counted")
        unknown_of.append(PREEMPTION)
    elif incidents >= settings.preemption_incidents:
        why_none = no_better()
        if why_none is not None:
            reopen.append(
                f"{incidents} {PREEMPTION_ALERT} incidents within {settings.within_h:g} h and "
                f"no validated better configuration ({why_none})"
            )
            parts.append(PREEMPTION)
    return RetuneVerdict(instance, tuple(reopen), tuple(parts), tuple(unknown), tuple(unknown_of))


def _unknown(part: str, previous: Ground, current: Ground) -> str:
    what = {
        "vllm_version": "the vLLM version",
        "model": "the model",
        "workload_key": "the workload shape",
    }[part]
    if getattr(current, part) is None:
        why = {
            "vllm_version": "no /version read yet",
            "model": "not in the server's flags or metrics",
            "workload_key": "too little traffic observed yet",
        }[part]
        return f"{what} is unknown now ({why})"
    return f"the last tuning run did not record {what}"


def preemption_incidents(
    db_read: Callable[..., list[sqlite3.Row]], instance: str, since_wall_s: float
) -> int:
    """VllmPreemptionSpike firings on `instance` since `since_wall_s`, from the audit log (the
    sidecar audits every firing, so the count holds across restarts)."""
    rows = db_read(
        "SELECT COUNT(DISTINCT coalesce(incident_id, id)) FROM audit WHERE actor = 'rule' "
        "AND action = 'alert' AND decision = 'firing' AND target = ? AND wall_s >= ? "
        "AND json_extract(details_json, '$.labels.alertname') IN (?, ?)",
        (instance, since_wall_s, PREEMPTION_ALERT, PREEMPTION_ALERT_BEFORE),
    )
    return int(rows[0][0])


def stable_name(instances: Sequence[Instance]) -> str | None:
    """The instance tuning is for: the first stable one the runtime lists."""
    return next((i.name for i in instances if i.role == "stable"), None)


def sidecar_ground(
    instances: Callable[[], Sequence[Instance]],
    latest_vllm: Callable[[str], VllmScrape | None],
    workload_key: WorkloadKey,
) -> Callable[[str], Ground]:
    """The ground an instance stands on now: the version its last scrape read from
    `/version`, the model its flags name (else the one its metrics report), and the coarse
    workload shape."""

    def ground(name: str) -> Ground:
        scrape = latest_vllm(name)
        instance = next((i for i in instances() if i.name == name), None)
        model = argv_model(instance.argv) if instance else None
        if model is None and scrape is not None and scrape.engines:
            model = scrape.engines[0].model_name
        version = scrape.vllm_version if scrape is not None else None
        return Ground(version, model or None, workload_key())

    return ground


class RetuneWatch:
    """Checks the stable instance at most every `check_every_s` (`check`, after each tick);
    its alerts reach the tracker through `take_events`, like the remediator's pages."""

    def __init__(
        self,
        settings: RetuneConfig,
        store: StateStore,
        *,
        instance: Callable[[], str | None],
        ground: Callable[[str], Ground],
        better: Better,
        schedule: Reopenable | None = None,
        restored: Iterable[AlertView] = (),
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        check_every_s: float = DEFAULT_CHECK_EVERY_S,
    ) -> None:
        self._settings = settings
        self._store = store
        self._grounds = GroundStore(store.db)
        self._instance = instance
        self._ground = ground
        self._better = better
        self._schedule = schedule
        self._wall = wall_clock
        self._clock = clock
        self._every_s = check_every_s
        self._last_check_s: float | None = None
        self._waiting: list[AlertEvent] = []
        self._said: dict[str, tuple[str, ...]] = {}  # the last verdict audited, per instance
        # What is re-opened now, per instance: its reasons and parts (an open alert's event).
        self._open: dict[str, tuple[tuple[str, ...], tuple[str, ...], AlertEvent | None]] = {}
        for alert in restored:  # an alert an earlier kvpilot left firing stays open
            labels, notes = dict(alert.labels), dict(alert.annotations)
            if (
                alert.rule == TUNING_RECOMMENDED_ALERT
                and labels.get("rule") == RETUNE_RULE
                and alert.state in ("pending", "firing")
            ):
                parts = tuple(p for p in notes.get(PARTS_ANNOTATION, "").split(",") if p)
                event = _event(labels.get("instance", ""), ("(restored)",), parts, 0.0)
                self._open[labels.get("instance", "")] = ((), parts, event)
        self.checks_total = 0
        self.no_verdicts_total = 0
        self.errors_total = 0

    def take_events(self) -> list[AlertEvent]:
        """Alert events since the last call, for the tracker."""
        events, self._waiting = self._waiting, []
        return events

    def check(self) -> RetuneVerdict | None:
        """One check when due; None when not due, no stable instance is listed, or the check
        failed (logged and counted: the next one tries again)."""
        now_s = self._clock()
        if self._last_check_s is not None and now_s - self._last_check_s < self._every_s:
            return None
        self._last_check_s = now_s
        name = self._instance()
        if name is None:
            return None
        try:
            verdict = self._verdict(name, self._wall())
            self._act(verdict, self._wall())
        except Exception as exc:  # the sidecar ticks on; the next check tries again
            self.errors_total += 1
            log.warning(
                "instance %s: the re-tune check failed: %s: %s", name, type(exc).__name__, exc
            )
            return None
        self.checks_total += 1
        return verdict

    def tuned(self, name: str | None = None) -> None:
        """A tuning run of `name` (default: the stable instance) completed: its ground now is
        the ground tuning stands on; what it re-opened resolves at the next check."""
        name = name or self._instance()
        if name is None:
            return
        try:
            self._grounds.save(name, self._ground(name), self._wall())
        except sqlite3.Error as exc:  # the run itself stands; the next run records again
            self.errors_total += 1
            log.warning("instance %s: the ground of the tuning run was not recorded: %s", name, exc)
        self._last_check_s = None  # decide again at the next check

    def _verdict(self, name: str, now_wall_s: float) -> RetuneVerdict:
        tuned = self._grounds.load(name)
        since = now_wall_s - self._settings.within_h * 3600.0
        if tuned is not None:  # incidents before the last run were tuned for
            since = max(since, tuned.tuned_wall_s)
        try:
            incidents: int | None = preemption_incidents(self._store.db.read, name, since)
        except sqlite3.Error as exc:
            log.warning("instance %s: VllmPreemptionSpike incidents unreadable: %s", name, exc)
            incidents = None
        return decide(
            name,
            tuned,
            self._ground(name),
            incidents,
            self._settings,
            lambda: self._no_better(name),
        )

    def _no_better(self, name: str) -> str | None:
        if self._better(name) is not None:
            return None
        return getattr(self._better, "last_reason", None) or "none found"

    def _act(self, verdict: RetuneVerdict, now_wall_s: float) -> None:
        name = verdict.instance
        was = self._open.get(name)
        if verdict.reopen:
            if was is not None and was[0] == verdict.reopen:
                return  # the same change: said once
            self._reopen(verdict, now_wall_s)
        elif was is not None and not set(was[1]) & set(verdict.unknown_parts):
            del self._open[name]  # tuning ran, or the ground is back
            if was[2] is not None:
                self._waiting.append(resolved(was[2], now_wall_s))
            self._audit(verdict, "settled", "tuning ran on this ground, or the ground is back")
            # What holds now was said by "settled": the same verdict next is not news.
            self._said[name] = (verdict.decision, _holds(verdict))
        elif was is None:
            if verdict.unknown:
                self.no_verdicts_total += 1
            self._audit(verdict, verdict.decision, _holds(verdict))

    def _reopen(self, verdict: RetuneVerdict, now_wall_s: float) -> None:
        name, why = verdict.instance, "; ".join(verdict.reopen)
        if self._schedule is not None:
            was = self._open.get(name)
            if was is not None and was[2] is not None:  # an alert from before the schedule
                self._waiting.append(resolved(was[2], now_wall_s))
            self._schedule.reopen(why)
            upcoming = self._schedule.next_fire_time(datetime.fromtimestamp(now_wall_s, UTC))
            at = upcoming.isoformat(timespec="minutes") if upcoming else "the next firing"
            self._open[name] = (verdict.reopen, verdict.parts, None)
            self._audit(verdict, "scheduled", f"{why}: scheduled tuning re-tunes at {at}")
            return
        event = _event(name, verdict.reopen, verdict.parts, now_wall_s)
        self._open[name] = (verdict.reopen, verdict.parts, event)
        self._waiting.append(event)
        self._audit(verdict, "recommended", why)

    def _audit(self, verdict: RetuneVerdict, decision: str, reason: str) -> None:
        key = (decision, reason)
        if self._said.get(verdict.instance) == key:
            return
        self._said[verdict.instance] = key
        log.info("instance %s: re-tune %s: %s", verdict.instance, decision, reason)
        self._store.record_audit(
            wall_s=self._wall(),
            actor="agent",
            action="retune",
            target=verdict.instance,
            decision=decision,
            reason=reason,
            details={"reopen": list(verdict.reopen), "unknown": list(verdict.unknown)},
        )


def _holds(verdict: RetuneVerdict) -> str:
    return "; ".join(verdict.unknown) or "the ground holds"


def _event(
    instance: str, reasons: tuple[str, ...], parts: tuple[str, ...], wall_s: float
) -> AlertEvent:
    labels = labels_of(
        {
            "alertname": TUNING_RECOMMENDED_ALERT,
            "instance": instance,
            "rule": RETUNE_RULE,
            "severity": "info",
        }
    )
    why = "; ".join(reasons)
    summary = f"re-tune {instance}: {why}"
    description = (
        f"{summary}. The configuration tuned for {instance} was chosen on other ground: run "
        "`kvpilot tune`, or set tuning.schedule so that kvpilot run re-tunes itself."
    )
    return AlertEvent(
        fingerprint=fingerprint(labels),
        incident_id=f"retune-{instance}-{int(wall_s)}",
        status="firing",
        labels=labels,
        annotations=labels_of(
            {"summary": summary, "description": description, PARTS_ANNOTATION: ",".join(parts)}
        ),
        starts_at_wall_s=wall_s,
        ends_at_wall_s=None,
        generator_url="",
    )


def retune_watch(
    settings: RetuneConfig,
    store: StateStore,
    *,
    instances: Callable[[], Sequence[Instance]],
    latest_vllm: Callable[[str], VllmScrape | None],
    better: Better,
    workload_key: WorkloadKey,
    schedule: Reopenable | None,
    restored: Iterable[AlertView],
) -> RetuneWatch | None:
    """The sidecar's watch over its stable instance (None when `retune.enabled` is off)."""
    if not settings.enabled:
        return None
    return RetuneWatch(
        settings,
        store,
        instance=lambda: stable_name(instances()),
        ground=sidecar_ground(instances, latest_vllm, workload_key),
        better=better,
        schedule=schedule,
        restored=restored,
        check_every_s=settings.check_every_s,
    )
