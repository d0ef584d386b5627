"""Thousands of engines are not thousands of alerts: the tracker holds at most `max_alerts`
alerts at once, admits new ones the most severe first, keeps the lifecycle of those it holds,
and says what it held back with one alert of its own (KvpilotAlertsLimited)."""

from __future__ import annotations

import itertools

import pytest

from kvpilot.agent.alerts import AlertTracker
from kvpilot.agent.model import Condition, labels_of

WALL = 1_700_000_000.0
LIMITED = "KvpilotAlertsLimited"
DEFAULT_MAX = 1_000  # alerts pending, firing or resolved at once, unless told otherwise


def engine(n: int, active: bool | None = True, severity: str = "warning") -> Condition:
    labels = labels_of(
        {"alertname": "VllmKvCacheSaturated", "instance": "vllm-0", "engine": str(n)}
        | {"severity": severity}
    )
    return Condition(
        rule="kv_saturation",
        labels=labels,
        active=active,
        value=0.99,
        summary="s",
        annotations=labels_of({"summary": "saturated"}),
    )


def tracker(**kwargs: object) -> AlertTracker:
    ids = (f"inc{i}" for i in itertools.count(1))
    return AlertTracker(
        new_id=lambda: next(ids),
        resolved_retention_s=50.0,
        **kwargs,  # type: ignore[arg-type]
    )


def by_name(t: AlertTracker) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for alert in t.alerts():
        out.setdefault(dict(alert.labels)["alertname"], []).append(alert.state)
    return out


def test_five_thousand_engines_make_a_bounded_number_of_alerts_and_events() -> None:
    t = tracker()
    flood = [engine(n) for n in range(5_000)]
    pages = [engine(n, severity="critical") for n in range(5_000, 5_003)]
    transitions = t.update([*flood, *pages], 0.0, WALL)
    events = [tr.event for tr in transitions if tr.event is not None]
    assert len(events) == DEFAULT_MAX + 1  # the admitted alerts and the limit's own
    states = by_name(t)
    assert len(states["VllmKvCacheSaturated"]) == DEFAULT_MAX
    # The most severe first: every critical alert is among those admitted.
    admitted = {dict(a.labels).get("engine") for a in t.alerts() if a.state == "firing"}
    assert {"5000", "5001", "5002"} <= admitted
    (limit,) = [a for a in t.alerts() if dict(a.labels)["alertname"] == LIMITED]
    assert limit.state == "firing" and limit.value == 5_003 - DEFAULT_MAX
    assert "4003 alerts held back" in dict(limit.annotations)["summary"]
    # The next tick of the same flood sends nothing new and tracks nothing more.
    again = t.update([*flood, *pages], 1.0, WALL + 1.0)
    assert [tr for tr in again if tr.event is not None] == []
    assert len(t.alerts()) == DEFAULT_MAX + 1


def test_held_back_alerts_start_once_room_is_made_and_the_limit_resolves() -> None:
    t = tracker(max_alerts=2)
    a, b, c = engine(0), engine(1), engine(2)
    t.update([a, b, c], 0.0, WALL)
    assert by_name(t) == {"VllmKvCacheSaturated": ["firing", "firing"], LIMITED: ["firing"]}
    # a ends: its resolution goes out as for any alert; the resolved one holds its slot.
    (resolved,) = [tr for tr in t.update([engine(0, False), b, c], 10.0, WALL + 10) if tr.event]
    assert resolved.event is not None and resolved.event.status == "resolved"
    assert resolved.fingerprint == a.fingerprint
    assert len(by_name(t)["VllmKvCacheSaturated"]) == 2  # c still held back
    # Once the resolved one ages out (50 s), c starts and nothing is held back any more.
    t.update([engine(0, False), b, c], 61.0, WALL + 61)
    later = t.update([engine(0, False), b, c], 62.0, WALL + 62)
    firing = {dict(x.labels).get("engine") for x in t.alerts() if x.state == "firing"}
    assert {"1", "2"} <= firing
    limit = [tr for tr in later if dict(tr.labels)["alertname"] == LIMITED]
    assert [(tr.from_state, tr.to_state) for tr in limit] == [("firing", "resolved")]


def test_an_alert_held_back_leaves_no_record_behind() -> None:
    t = tracker(max_alerts=1)
    t.update([engine(0)], 0.0, WALL)
    for tick in range(1, 200):  # a new engine every tick, as labels that change per scrape
        t.update([engine(0), engine(tick)], float(tick), WALL + tick)
    assert len(t.alerts()) == 2  # the one admitted and the limit's own
    assert len(t.to_rows()) == 2


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_alerts"):
        tracker(max_alerts=0)


def test_a_new_critical_takes_the_place_of_the_oldest_resolved_one() -> None:
    t = tracker(max_alerts=3)
    t.update([engine(0), engine(1), engine(2)], 0.0, WALL)
    t.update([engine(0, False), engine(1), engine(2)], 1.0, WALL + 1)  # 0 resolves first
    t.update([engine(0, False), engine(1, False), engine(2)], 2.0, WALL + 2)
    page = engine(9, severity="critical")
    out = t.update([engine(0, False), engine(1, False), engine(2), page], 3.0, WALL + 3)
    (fired,) = [tr for tr in out if tr.event is not None]
    assert fired.fingerprint == page.fingerprint and fired.to_state == "firing"
    engines = {dict(a.labels)["engine"]: a.state for a in t.alerts() if a.state != "inactive"}
    assert engines == {"1": "resolved", "2": "firing", "9": "firing"}  # resolved 0 gave way
    assert LIMITED not in by_name(t)  # nothing is held back


def test_a_new_critical_takes_the_place_of_a_live_warning_whose_end_goes_out() -> None:
    """Before: the page waited behind the warnings (up to 15 minutes), and so did its restart."""
    t = tracker(max_alerts=2)
    t.update([engine(0, severity="info"), engine(1)], 0.0, WALL)
    page = engine(9, severity="critical")
    out = t.update([engine(0, severity="info"), engine(1), page], 1.0, WALL + 1)
    events = {(dict(tr.labels).get("engine"), tr.event.status) for tr in out if tr.event}
    # The info alert gives way (the lowest severity): its end goes out, saying why.
    assert ("9", "firing") in events and ("0", "resolved") in events
    (ended,) = [tr for tr in out if dict(tr.labels).get("engine") == "0"]
    assert ended.reason is not None and "critical alert needed the place" in ended.reason
    assert ended.event is not None
    assert "evicted" in dict(ended.event.annotations)["resolved_reason"]
    engines = {dict(a.labels).get("engine"): a.state for a in t.alerts()}
    assert engines == {"1": "firing", "9": "firing", None: "firing"}  # None: the limit's own
    (limit,) = [a for a in t.alerts() if dict(a.labels)["alertname"] == LIMITED]
    assert limit.value == 1  # the info alert, still active, is now held back


def test_a_live_critical_keeps_its_place_and_a_warning_waits() -> None:
    t = tracker(max_alerts=1)
    first = engine(0, severity="critical")
    t.update([first], 0.0, WALL)
    out = t.update([first, engine(1, severity="critical"), engine(2)], 1.0, WALL + 1)
    assert [tr for tr in out if tr.event and dict(tr.labels)["alertname"] != LIMITED] == []
    assert {dict(a.labels).get("engine") for a in t.alerts()} == {"0", None}
