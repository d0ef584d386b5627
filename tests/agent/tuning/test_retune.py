"""Re-tuning when the ground moves: the ground and its reasons, its persistence, preemption
incidents counted on a fake clock, the scheduled and the alert paths, resolution, and one
decision per change. Real SQLite in a temp dir; no vLLM."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from kvpilot.agent.alert_values import AlertView
from kvpilot.agent.config.tuning import RetuneConfig, TuningConfig
from kvpilot.agent.model import AlertEvent
from kvpilot.agent.remediation.events import TUNING_RECOMMENDED_ALERT
from kvpilot.agent.state import StateStore
from kvpilot.agent.tuning.ground import Ground, GroundStore, moved
from kvpilot.agent.tuning.retune import RETUNE_RULE, RetuneVerdict, RetuneWatch

NAME = "vllm"
HOUR_S = 3600.0


class Clock:
    def __init__(self, wall_s: float = 1_000_000.0) -> None:
        self.wall_s = wall_s

    def __call__(self) -> float:
        return self.wall_s


class Schedule:
    """Stands in for `ScheduledTuning` (its reopen is tested on the real class below)."""

    def __init__(self) -> None:
        self.reopened: list[str] = []

    def reopen(self, reason: str) -> None:
        self.reopened.append(reason)

    def next_fire_time(self, now: datetime) -> datetime | None:
        return now + timedelta(hours=1)


class Better:
    """The ladder's BetterConfig: a validated better argv, or None with the reason."""

    def __init__(self, argv: tuple[str, ...] | None = None) -> None:
        self.argv = argv
        self.last_reason: str | None = None

    def __call__(self, instance: str) -> tuple[str, ...] | None:
        self.last_reason = None if self.argv else "no trial of study abc was judged pass"
        return self.argv


@pytest.fixture
def store(tmp_path: Path):
    with StateStore.open(tmp_path / "state") as opened:
        yield opened


def watch(
    store: StateStore,
    now: Ground,
    clock: Clock,
    *,
    better: Better | None = None,
    schedule: Schedule | None = None,
    restored: tuple[AlertView, ...] = (),
    settings: RetuneConfig | None = None,
    ground: list[Ground] | None = None,
) -> RetuneWatch:
    current = ground if ground is not None else [now]
    return RetuneWatch(
        settings or RetuneConfig(),
        store,
        instance=lambda: NAME,
        ground=lambda _name: current[-1],
        better=better or Better(),
        schedule=schedule,
        restored=restored,
        wall_clock=clock,
        clock=clock,
        check_every_s=0.0,
    )


def fired(events: list[AlertEvent], status: str = "firing") -> list[AlertEvent]:
    return [e for e in events if e.status == status]


def spike(
    store: StateStore, wall_s: float, incident: str, alertname: str = "VllmPreemptionSpike"
) -> None:
    """A VllmPreemptionSpike firing as the sidecar audits it."""
    store.record_audit(
        wall_s=wall_s,
        actor="rule",
        action="alert",
        target=NAME,
        decision="firing",
        reason="preemptions",
        incident_id=incident,
        details={"labels": {"alertname": alertname, "instance": NAME}},
    )


def retune_audits(store: StateStore) -> list[tuple[str, str]]:
    rows = store.audit_records(limit=1000)
    return [(r.decision, r.reason) for r in reversed(rows) if r.action == "retune"]


# -- the ground --------------------------------------------------------------------------


def test_moved_names_each_part_that_moved() -> None:
    was = Ground("0.9.1", "a", "p512-o64-r1")
    assert moved(was, was) == ()
    assert moved(was, Ground("0.10.0", "b", "p2048-o64-r1")) == (
        "vLLM 0.9.1 -> 0.10.0",
        "model a -> b",
        "workload shape moved: p512-o64-r1 -> p2048-o64-r1",
    )


def test_a_part_either_side_does_not_know_is_no_evidence_of_a_move() -> None:
    assert moved(Ground(None, "a", None), Ground("0.10.0", "a", "k")) == ()
    assert moved(Ground("0.9.1", "a", "k"), Ground(None, None, None)) == ()


def test_the_tuned_ground_survives_a_restart_of_the_agent(tmp_path: Path) -> None:
    with StateStore.open(tmp_path / "state") as first:
        assert GroundStore(first.db).load(NAME) is None
        GroundStore(first.db).save(NAME, Ground("0.9.1", "m", None), 123.0)
        GroundStore(first.db).save(NAME, Ground("0.10.0", "m", "k"), 456.0)  # the latest run
    with StateStore.open(tmp_path / "state") as again:
        tuned = GroundStore(again.db).load(NAME)
    assert tuned is not None
    assert tuned.ground == Ground("0.10.0", "m", "k") and tuned.tuned_wall_s == 456.0


# -- the verdict -------------------------------------------------------------------------


def test_missing_data_is_no_verdict_with_the_reason_audited_once(store: StateStore) -> None:
    clock = Clock()
    w = watch(store, Ground(None, "m", None), clock)
    first = w.check()
    assert isinstance(first, RetuneVerdict) and first.decision == "no verdict"
    assert "no tuning run recorded yet" in first.unknown[0]
    GroundStore(store.db).save(NAME, Ground("0.9.1", "m", None), clock())
    verdict = w.check()
    assert verdict is not None and verdict.decision == "no verdict" and verdict.reopen == ()
    assert any("vLLM version is unknown now" in u for u in verdict.unknown)
    w.check()
    assert w.take_events() == []
    audits = retune_audits(store)
    assert [d for d, _ in audits] == ["no verdict", "no verdict"]  # each change once
    assert w.no_verdicts_total == 3


def test_a_new_version_alerts_once_and_resolves_once_tuning_ran(store: StateStore) -> None:
    clock = Clock()
    GroundStore(store.db).save(NAME, Ground("0.9.1", "m", None), clock())
    w = watch(store, Ground("0.10.0", "m", None), clock)
    verdict = w.check()
    assert verdict is not None and verdict.reopen == ("vLLM 0.9.1 -> 0.10.0",)
    events = w.take_events()
    assert len(fired(events)) == 1
    labels = dict(events[0].labels)
    assert labels["alertname"] == TUNING_RECOMMENDED_ALERT and labels["rule"] == RETUNE_RULE
    assert "vLLM 0.9.1 -> 0.10.0" in dict(events[0].annotations)["summary"]
    for _ in range(5):  # the same change: no new event, no new audit
        clock.wall_s += 60
        w.check()
    assert w.take_events() == []
    w.tuned()  # a tuning run completed on 0.10.0
    w.check()
    ended = w.take_events()
    assert [e.status for e in ended] == ["resolved"]
    assert ended[0].fingerprint == events[0].fingerprint
    assert [d for d, _ in retune_audits(store)] == ["recommended", "settled"]
    stored = GroundStore(store.db).load(NAME)
    assert stored is not None and stored.ground.vllm_version == "0.10.0"


def test_the_alert_resolves_when_the_ground_is_back(store: StateStore) -> None:
    clock = Clock()
    GroundStore(store.db).save(NAME, Ground("0.9.1", "a", "k1"), clock())
    now = [Ground("0.9.1", "b", "k1")]
    w = watch(store, now[0], clock, ground=now)
    w.check()
    assert len(fired(w.take_events())) == 1
    now.append(Ground(None, "b", "k1"))  # the version unknown: nothing changes
    w.check()
    assert w.take_events() == []
    now.append(Ground("0.9.1", "b", "k2"))  # another change: said once more
    w.check()
    again = w.take_events()
    assert len(fired(again)) == 1
    assert "workload shape moved: k1 -> k2" in dict(again[0].annotations)["summary"]
    now.append(Ground(None, "a", "k1"))  # back, with the version unknown
    w.check()
    assert [e.status for e in w.take_events()] == ["resolved"]


def test_a_moved_ground_with_a_schedule_reopens_it_instead_of_alerting(store: StateStore) -> None:
    clock = Clock()
    GroundStore(store.db).save(NAME, Ground("0.9.1", "a", None), clock())
    schedule = Schedule()
    w = watch(store, Ground("0.9.1", "b", None), clock, schedule=schedule)
    w.check()
    w.check()
    assert schedule.reopened == ["model a -> b"]  # once per change
    assert w.take_events() == []
    decision, reason = retune_audits(store)[-1]
    assert decision == "scheduled" and "scheduled tuning re-tunes at" in reason


# -- preemption incidents ----------------------------------------------------------------


def test_preemption_incidents_that_keep_coming_reopen_tuning(store: StateStore) -> None:
    clock = Clock()
    GroundStore(store.db).save(NAME, Ground(None, None, None), clock() - 48 * HOUR_S)
    w = watch(store, Ground(None, None, None), clock)
    spike(store, clock() - 30 * HOUR_S, "old")  # outside the 24 h window
    spike(store, clock() - 3 * HOUR_S, "i1")
    spike(store, clock() - 2 * HOUR_S, "i2")
    w.check()
    assert w.take_events() == []  # two within 24 h: not yet
    spike(store, clock() - 1 * HOUR_S, "i3")
    w.check()
    events = w.take_events()
    assert len(fired(events)) == 1
    summary = dict(events[0].annotations)["summary"]
    assert "3 VllmPreemptionSpike incidents within 24 h" in summary
    assert "no trial of study abc was judged pass" in summary
    clock.wall_s += 22.5 * HOUR_S  # i1 and i2 leave the window
    w.check()
    assert [e.status for e in w.take_events()] == ["resolved"]


def test_firings_audited_under_the_alerts_earlier_name_count(store: StateStore) -> None:
    clock = Clock()
    settings = RetuneConfig(preemption_incidents=2, within_h=6)
    w = watch(store, Ground(None, None, None), clock, settings=settings)
    spike(store, clock() - 60.0, "before-the-rename", alertname="PreemptionSpike")
    spike(store, clock() - 60.0, "other", alertname="VllmKvCacheSaturated")  # not a spike
    w.check()
    assert w.take_events() == []
    spike(store, clock() - 30.0, "after-the-rename")
    w.check()
    assert len(fired(w.take_events())) == 1


def test_incidents_do_not_reopen_tuning_while_a_validated_better_config_exists(
    store: StateStore,
) -> None:
    clock = Clock()
    w = watch(store, Ground(None, None, None), clock, better=Better(("vllm", "serve", "m")))
    for i in range(4):
        spike(store, clock() - i * 60.0, f"i{i}")
    verdict = w.check()
    assert verdict is not None and verdict.reopen == ()
    assert w.take_events() == []


def test_incidents_before_the_last_tuning_run_do_not_count(store: StateStore) -> None:
    clock = Clock()
    settings = RetuneConfig(preemption_incidents=2, within_h=6)
    w = watch(store, Ground(None, None, None), clock, settings=settings)
    spike(store, clock() - 60.0, "i1")
    spike(store, clock() - 30.0, "i2")
    w.check()
    assert len(fired(w.take_events())) == 1
    w.tuned()
    clock.wall_s += 60.0
    w.check()
    assert [e.status for e in w.take_events()] == ["resolved"]


# -- restarts, the schedule, the configuration ---------------------------------------------


def test_an_alert_left_firing_by_an_earlier_agent_resolves_when_the_ground_holds(
    store: StateStore,
) -> None:
    clock = Clock()
    GroundStore(store.db).save(NAME, Ground("0.10.0", "m", None), clock())
    first = watch(store, Ground("0.11.0", "m", None), clock)
    first.check()
    event = fired(first.take_events())[0]
    left = AlertView(
        fingerprint=event.fingerprint,
        rule=TUNING_RECOMMENDED_ALERT,
        labels=event.labels,
        annotations=event.annotations,
        state="firing",
        active=True,
        value=None,
        reason=None,
        active_since_wall_s=clock(),
        incident_id=event.incident_id,
    )
    GroundStore(store.db).save(NAME, Ground("0.11.0", "m", None), clock())  # tuned meanwhile
    again = watch(store, Ground("0.11.0", "m", None), clock, restored=(left,))
    again.check()
    ended = again.take_events()
    assert [(e.status, e.fingerprint) for e in ended] == [("resolved", event.fingerprint)]


def test_the_next_firing_says_it_was_reopened() -> None:
    asyncio.run(_the_next_firing_says_it_was_reopened())


async def _the_next_firing_says_it_was_reopened() -> None:
    from kvpilot.agent.tuning.schedule import ScheduledTuning

    said: list[tuple[str, str]] = []
    tuned: list[bool] = []

    async def run_once() -> str:
        tuned.append(True)
        return "ran 1 trials"

    scheduled = ScheduledTuning(
        "0 3 * * *",
        run_once,
        remediation_in_progress=lambda: False,
        audit=lambda d, r: said.append((d, r)),
    )
    await scheduled.start_up()
    scheduled.reopen("vLLM 0.9.1 -> 0.10.0")
    await scheduled.fire()
    await scheduled.fire()
    started = [r for d, r in said if d == "started"]
    assert started == [
        "scheduled tuning run, re-opened: vLLM 0.9.1 -> 0.10.0",
        "scheduled tuning run",
    ]


def test_the_retune_settings_are_validated() -> None:
    assert TuningConfig().retune == RetuneConfig(
        enabled=True, preemption_incidents=3, within_h=24.0
    )
    for bad in (
        {"preemption_incidents": 0},
        {"within_h": 0},
        {"check_every_s": -1},
        {"incidents": 3},
    ):
        with pytest.raises(ValueError):
            RetuneConfig.model_validate(bad)


def test_an_alert_from_before_a_schedule_resolves_when_the_schedule_takes_over(
    store: StateStore,
) -> None:
    clock = Clock()
    GroundStore(store.db).save(NAME, Ground("0.9.1", "m", None), clock())
    first = watch(store, Ground("0.10.0", "m", None), clock)
    first.check()
    event = fired(first.take_events())[0]
    left = AlertView(
        fingerprint=event.fingerprint,
        rule=TUNING_RECOMMENDED_ALERT,
        labels=event.labels,
        annotations=event.annotations,
        state="firing",
        active=True,
        value=None,
        reason=None,
        active_since_wall_s=clock(),
        incident_id=event.incident_id,
    )
    schedule = Schedule()
    again = watch(store, Ground("0.10.0", "m", None), clock, schedule=schedule, restored=(left,))
    again.check()
    assert [(e.status, e.fingerprint) for e in again.take_events()] == [
        ("resolved", event.fingerprint)
    ]
    assert schedule.reopened == ["vLLM 0.9.1 -> 0.10.0"]


def test_a_check_that_fails_is_counted_not_raised(store: StateStore) -> None:
    def broken(_name: str) -> Ground:
        raise RuntimeError("the scrape went away")

    w = RetuneWatch(
        RetuneConfig(),
        store,
        instance=lambda: NAME,
        ground=broken,
        better=Better(),
        check_every_s=0.0,
    )
    assert w.check() is None
    assert w.errors_total == 1 and w.take_events() == []


def test_a_ground_that_cannot_be_written_does_not_fail_the_run(store: StateStore) -> None:
    clock = Clock()
    w = watch(store, Ground("0.10.0", "m", None), clock)
    store.db.read("PRAGMA query_only = ON")  # every write now fails as on a read-only file
    w.tuned()
    assert w.errors_total == 1
    store.db.read("PRAGMA query_only = OFF")
    assert GroundStore(store.db).load(NAME) is None
