from __future__ import annotations

import dataclasses
import itertools

import pytest

from kvpilot.agent.alerts import AlertTracker
from kvpilot.agent.model import Condition, fingerprint, labels_of

WALL = 1_700_000_000.0
# Each rule's `for_s`, as its conditions carry it.
FOR_S = {"kv_saturation": 10.0, "instant": 0.0}
LABELS = labels_of({"alertname": "VllmKvCacheSaturated", "instance": "vllm-0", "role": "stable"})


def cond(active: bool | None, labels=LABELS, rule: str = "kv_saturation") -> Condition:
    return Condition(
        rule=rule,
        labels=labels,
        active=active,
        value=None,
        summary="s",
        reason=None if active is not None else "source down",
        annotations=labels_of({"summary": "s"}),
        for_s=FOR_S[rule],
    )


def make(ids=None, **kwargs) -> AlertTracker:
    ids = ids if ids is not None else (f"inc{i}" for i in itertools.count(1))
    defaults = dict(repeat_interval_s=100.0, resolved_retention_s=50.0, gone_grace_s=30.0)
    defaults.update(kwargs)
    return AlertTracker(new_id=lambda: next(ids), **defaults)


def step(tracker: AlertTracker, t: float, *conditions: Condition):
    return tracker.update(list(conditions), t, WALL + t)


def states(tracker: AlertTracker) -> dict[str, str]:
    return {a.fingerprint: a.state for a in tracker.alerts()}


FP = fingerprint(LABELS)


def test_pending_then_firing_after_for_then_resolved() -> None:
    tracker = make()
    [t0] = step(tracker, 0.0, cond(True))
    assert (t0.from_state, t0.to_state, t0.event) == ("inactive", "pending", None)
    assert step(tracker, 9.9, cond(True)) == []
    [fired] = step(tracker, 10.0, cond(True))
    assert (fired.from_state, fired.to_state) == ("pending", "firing")
    assert fired.event is not None and fired.event.status == "firing"
    assert fired.event.incident_id == "inc1" and fired.incident_id == "inc1"
    assert fired.event.starts_at_wall_s == WALL + 0.0
    assert fired.event.fingerprint == FP
    assert step(tracker, 11.0, cond(True)) == []
    [resolved] = step(tracker, 12.0, cond(False))
    assert (resolved.from_state, resolved.to_state) == ("firing", "resolved")
    assert resolved.event is not None and resolved.event.status == "resolved"
    assert resolved.event.incident_id == "inc1"
    assert resolved.event.ends_at_wall_s == WALL + 12.0
    assert resolved.event.starts_at_wall_s == WALL + 0.0


def test_zero_for_fires_at_once() -> None:
    tracker = make()
    [t] = step(tracker, 0.0, cond(True, rule="instant"))
    assert (t.from_state, t.to_state) == ("inactive", "firing")
    assert t.event is not None


def test_flapping_restarts_the_for_clock_and_makes_new_incidents() -> None:
    tracker = make()
    step(tracker, 0.0, cond(True))
    [back] = step(tracker, 5.0, cond(False))
    assert (back.from_state, back.to_state) == ("pending", "inactive")
    step(tracker, 6.0, cond(True))
    assert step(tracker, 15.0, cond(True)) == []  # 9 s since it came back: not yet
    [fired] = step(tracker, 16.0, cond(True))
    assert fired.to_state == "firing" and fired.event is not None
    assert fired.event.starts_at_wall_s == WALL + 6.0
    step(tracker, 17.0, cond(False))
    step(tracker, 18.0, cond(True))
    [again] = step(tracker, 28.0, cond(True))
    assert again.incident_id == "inc2"
    assert again.event is not None and again.event.dedup_key != fired.event.dedup_key


def test_the_for_s_each_condition_carries_decides_and_a_pending_alert_keeps_its_start() -> None:
    """A reloaded rule's conditions carry its new `for_s`: the pending alert fires once that
    much has passed since it became active, not since the reload."""
    tracker = make()
    longer = dataclasses.replace(cond(True), for_s=60.0)
    assert [t.to_state for t in step(tracker, 0.0, longer)] == ["pending"]
    assert step(tracker, 30.0, longer) == []
    shorter = dataclasses.replace(cond(True), for_s=5.0)
    assert [t.to_state for t in step(tracker, 31.0, shorter)] == ["firing"]


def test_unknown_holds_pending_and_firing() -> None:
    tracker = make()
    step(tracker, 0.0, cond(True))
    assert step(tracker, 20.0, cond(None)) == []  # does not advance to firing
    assert states(tracker)[FP] == "pending"
    [fired] = step(tracker, 21.0, cond(True))  # the for clock kept running from t=0
    assert fired.to_state == "firing"
    assert step(tracker, 22.0, cond(None)) == []  # does not resolve
    assert states(tracker)[FP] == "firing"
    view = {a.fingerprint: a for a in tracker.alerts()}[FP]
    assert view.active is None and view.reason == "source down"


def test_unknown_with_no_state_stays_inactive() -> None:
    tracker = make()
    assert step(tracker, 0.0, cond(None)) == []
    assert states(tracker)[FP] == "inactive"
    assert tracker.to_rows() == []


def test_repeat_interval_keeps_incident_and_starts_at() -> None:
    tracker = make()
    step(tracker, 0.0, cond(True, rule="instant"))
    assert step(tracker, 99.0, cond(True, rule="instant")) == []
    [repeat] = step(tracker, 100.0, cond(True, rule="instant"))
    assert repeat.repeat and repeat.event is not None
    assert repeat.event.incident_id == "inc1"
    assert repeat.event.starts_at_wall_s == WALL
    assert step(tracker, 150.0, cond(None, rule="instant")) == []
    [while_unknown] = step(tracker, 200.0, cond(None, rule="instant"))
    assert while_unknown.repeat and while_unknown.event is not None


def test_a_vanished_target_resolves_after_the_grace_period() -> None:
    tracker = make()
    step(tracker, 0.0, cond(True, rule="instant"))
    assert step(tracker, 29.0) == []
    [gone] = step(tracker, 30.0)
    assert gone.to_state == "resolved" and gone.event is not None
    assert gone.event.status == "resolved"
    assert "target gone" in dict(gone.event.annotations)["resolved_reason"]
    # Kept for display until the retention passes, then dropped.
    assert states(tracker)[FP] == "resolved"
    step(tracker, 80.0)
    assert FP not in states(tracker)


def test_a_vanished_pending_alert_is_dropped_without_an_event() -> None:
    tracker = make()
    step(tracker, 0.0, cond(True))
    [t] = step(tracker, 31.0)
    assert (t.from_state, t.to_state, t.event) == ("pending", "inactive", None)
    assert FP not in states(tracker)


def test_alerts_are_independent_by_fingerprint() -> None:
    tracker = make()
    other = labels_of({**dict(LABELS), "instance": "vllm-1"})
    step(tracker, 0.0, cond(True), cond(False, labels=other))
    out = step(tracker, 10.0, cond(True), cond(True, labels=other))
    assert {(t.fingerprint, t.to_state) for t in out} == {
        (FP, "firing"),
        (fingerprint(other), "pending"),
    }


def test_silence_suppresses_notifications_not_state() -> None:
    tracker = make()
    silence = tracker.silence({"alertname": "VllmKvCacheSaturated"}, until_wall_s=WALL + 50.0)
    [fired] = step(tracker, 0.0, cond(True, rule="instant"))
    assert fired.to_state == "firing" and fired.event is None and fired.silenced
    assert step(tracker, 10.0, cond(True, rule="instant")) == []
    # The silence ends: the firing notification goes out then, same incident and start.
    [late] = step(tracker, 50.0, cond(True, rule="instant"))
    assert late.event is not None and late.event.incident_id == "inc1"
    assert late.event.starts_at_wall_s == WALL
    assert silence not in tracker.silences()


def test_silence_of_other_labels_does_not_match_and_can_be_expired() -> None:
    tracker = make()
    other = tracker.silence({"instance": "vllm-9"}, until_wall_s=WALL + 1000)
    mine = tracker.silence({"instance": "vllm-0"}, until_wall_s=WALL + 1000)
    assert tracker.expire_silence(mine.silence_id)
    [fired] = step(tracker, 0.0, cond(True, rule="instant"))
    assert fired.event is not None
    assert [s.silence_id for s in tracker.silences()] == [other.silence_id]
    with pytest.raises(ValueError):
        tracker.silence({}, until_wall_s=WALL)


def test_resolution_of_a_notified_incident_is_sent_even_under_a_silence() -> None:
    tracker = make()
    step(tracker, 0.0, cond(True, rule="instant"))
    tracker.silence({"alertname": "VllmKvCacheSaturated"}, until_wall_s=WALL + 1000)
    [resolved] = step(tracker, 5.0, cond(False, rule="instant"))
    assert resolved.event is not None and resolved.event.status == "resolved"


def test_a_never_notified_incident_resolves_quietly() -> None:
    tracker = make()
    tracker.silence({"alertname": "VllmKvCacheSaturated"}, until_wall_s=WALL + 1000)
    step(tracker, 0.0, cond(True, rule="instant"))
    [resolved] = step(tracker, 5.0, cond(False, rule="instant"))
    assert resolved.to_state == "resolved" and resolved.event is None


def _script() -> list[tuple[float, bool | None]]:
    return [
        (0.0, True),
        (4.0, True),
        (8.0, None),
        (12.0, True),
        (60.0, True),
        (113.0, True),
        (120.0, None),
        (230.0, True),
        (240.0, False),
        (250.0, True),
    ]


def _events(transitions) -> list[tuple]:
    return [
        (
            t.from_state,
            t.to_state,
            t.incident_id,
            t.repeat,
            None if t.event is None else t.event.dedup_key,
        )
        for t in transitions
    ]


@pytest.mark.parametrize("cut", range(1, 10))
def test_restore_from_rows_behaves_identically(cut: int) -> None:
    """Stopping after any tick and restoring (with another monotonic origin) changes nothing."""
    script = _script()
    reference = make()
    expected = [_events(step(reference, t, cond(a))) for t, a in script]

    ids = (f"inc{i}" for i in itertools.count(1))  # one id sequence across both processes
    first = make(ids)
    got = [_events(step(first, t, cond(a))) for t, a in script[:cut]]
    rows = first.to_rows()
    # A new process: the monotonic clock has another origin, wall time goes on.
    shift = 5_000.0
    restored = AlertTracker.from_rows(
        rows,
        repeat_interval_s=100.0,
        resolved_retention_s=50.0,
        gone_grace_s=30.0,
        new_id=lambda: next(ids),
    )
    for t, a in script[cut:]:
        got.append(_events(restored.update([cond(a)], t + shift, WALL + t)))
    assert got == expected


def test_rows_carry_wall_times() -> None:
    tracker = make()
    step(tracker, 0.0, cond(True))
    step(tracker, 10.0, cond(True))
    [row] = tracker.to_rows()
    assert row.state == "firing" and row.fingerprint == FP
    assert row.active_since_wall_s == WALL
    assert row.fired_at_wall_s == WALL + 10.0
    assert row.last_sent_wall_s == WALL + 10.0
    assert row.incident_id == "inc1"
    assert row.labels == LABELS
