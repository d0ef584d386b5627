"""StateStore: alerts and silences, remediations, audit, facts, retention, thread contract."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from kvpilot.agent.alert_values import Silence, StoredAlert
from kvpilot.agent.config import RetentionConfig
from kvpilot.agent.model import AlertEvent, labels_of
from kvpilot.agent.state import StateStore
from tests.agent.notify.notify_helpers import make_event


def event(n: int) -> AlertEvent:
    return make_event(instance=f"i{n}", incident_id=f"inc{n}")


DAY_S = 86400.0


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    with StateStore.open(tmp_path) as opened:
        yield opened


def alert_row(n: int, state: str = "firing") -> StoredAlert:
    return StoredAlert(
        fingerprint=f"fp{n}",
        rule="kv_saturation",
        labels=labels_of({"alertname": "kv_saturation", "instance": f"i{n}"}),
        annotations=labels_of({"summary": "KV full"}),
        state=state,  # type: ignore[arg-type]
        active_since_wall_s=100.0 + n,
        fired_at_wall_s=160.0 + n if state in ("firing", "resolved") else None,
        incident_id=f"inc{n}" if state != "pending" else None,
        last_sent_wall_s=161.0 + n if state == "firing" else None,
        last_seen_wall_s=200.0,
        resolved_at_wall_s=199.0 if state == "resolved" else None,
    )


def test_alerts_round_trip_across_a_reopen_and_are_replaced(tmp_path: Path) -> None:
    rows = [alert_row(1), alert_row(2, "pending"), alert_row(3, "resolved")]
    with StateStore.open(tmp_path) as store:
        store.save_alerts(rows)
    with StateStore.open(tmp_path) as store:
        assert store.load_alerts() == rows
        store.save_alerts(rows[1:2])
        assert store.load_alerts() == rows[1:2]
        store.save_alerts([])
        assert store.load_alerts() == []


def test_silences_round_trip_and_ended_ones_are_not_loaded(store: StateStore) -> None:
    live = Silence("s1", labels_of({"alertname": "engine_stall"}), until_wall_s=500.0, comment="x")
    ended = Silence("s2", labels_of({"instance": "a"}), until_wall_s=100.0)
    store.save_silences([live, ended])
    assert store.load_silences(now_wall_s=200.0) == [live]
    assert store.load_silences(now_wall_s=500.0) == []


def test_remediation_lifecycle(store: StateStore) -> None:
    rid = store.start_remediation(
        instance="a",
        action="restart",
        state="planned",
        reason="preemption spike",
        started_wall_s=1000.0,
        incident_id="inc1",
        fingerprint="fp1",
        old_pid=41,
    )
    store.update_remediation(rid, state="draining", now_wall_s=1001.0)
    (unfinished,) = store.remediations(unfinished_only=True)
    assert (unfinished.id, unfinished.state, unfinished.finished) == (rid, "draining", False)
    store.update_remediation(
        rid, state="succeeded", reason="healthy, probe answered", now_wall_s=1030.0, new_pid=42
    )
    record = store.remediation(rid)
    assert record is not None and record.finished
    assert (record.old_pid, record.new_pid, record.finished_wall_s) == (41, 42, 1030.0)
    assert record.reason == "healthy, probe answered"
    assert store.remediations(unfinished_only=True) == []
    assert [r.id for r in store.remediations(incident_id="inc1")] == [rid]
    assert store.remediations(incident_id="other") == []


def test_remediation_queries_filter_and_order_newest_first(store: StateStore) -> None:
    ids = [
        store.start_remediation(
            instance=inst, action="restart", state="skipped", reason="cooldown", started_wall_s=t
        )
        for inst, t in (("a", 10.0), ("b", 20.0), ("a", 30.0))
    ]
    assert [r.id for r in store.remediations(instance="a")] == [ids[2], ids[0]]
    assert [r.id for r in store.remediations(since_wall_s=20.0)] == [ids[2], ids[1]]
    assert [r.id for r in store.remediations(limit=1)] == [ids[2]]
    skipped = store.remediation(ids[0])
    assert skipped is not None and skipped.finished_wall_s == 10.0  # born finished


def test_remediation_errors(store: StateStore) -> None:
    with pytest.raises(ValueError, match="remediation state"):
        store.start_remediation(
            instance="a",
            action="restart",
            state="exploded",  # type: ignore[arg-type]
            reason="r",
            started_wall_s=1.0,
        )
    with pytest.raises(KeyError):
        store.update_remediation(999, state="failed", now_wall_s=1.0)


def test_audit_records_every_field(store: StateStore) -> None:
    rid = store.start_remediation(
        instance="a", action="restart", state="vetoed", reason="api veto", started_wall_s=5.0
    )
    first = store.record_audit(
        wall_s=5.0,
        actor="api",
        action="restart",
        target="a",
        decision="vetoed",
        reason="operator veto",
        remediation_id=rid,
        details={"user": "sre", "budget_left": 2},
    )
    store.record_audit(
        wall_s=6.0,
        actor="rule",
        action="restart",
        target="a",
        decision="skipped",
        reason="cooldown",
        incident_id="inc1",
    )
    newest, oldest = store.audit_records()
    assert oldest.id == first
    assert (oldest.actor, oldest.decision, oldest.remediation_id) == ("api", "vetoed", rid)
    assert oldest.details == {"user": "sre", "budget_left": 2}
    assert (newest.incident_id, newest.details) == ("inc1", {})
    assert [r.id for r in store.audit_records(since_wall_s=5.5)] == [newest.id]
    with pytest.raises(ValueError, match="actor"):
        store.record_audit(
            wall_s=1.0,
            actor="robot",
            action="x",
            target="a",  # type: ignore[arg-type]
            decision="d",
            reason="r",
        )


def test_facts(store: StateStore) -> None:
    assert store.get_fact("breaker/a") is None
    store.set_fact("breaker/a", {"open": True, "failures": 2}, 10.0)
    store.set_fact("breaker/a", {"open": False, "failures": 0}, 11.0)
    assert store.get_fact("breaker/a") == {"open": False, "failures": 0}
    store.delete_fact("breaker/a")
    assert store.get_fact("breaker/a") is None


def test_retention_deletes_only_old_finished_rows(store: StateStore) -> None:
    now = 100 * DAY_S
    policy = RetentionConfig(outbox_days=7, audit_days=30, remediations_days=30, silences_days=1)
    old_delivered = store.outbox.enqueue("hook", event(1), now - 20 * DAY_S)
    store.outbox.mark_delivered([old_delivered], now - 20 * DAY_S)
    old_given_up = store.outbox.enqueue("hook", event(2), now - 20 * DAY_S)
    store.outbox.mark_failed([old_given_up], "400", now - 19 * DAY_S, give_up=True)
    recent = store.outbox.enqueue("hook", event(3), now - 2 * DAY_S)
    store.outbox.mark_delivered([recent], now - 2 * DAY_S)
    old_pending = store.outbox.enqueue("hook", event(4), now - 50 * DAY_S)

    old_rem = store.start_remediation(
        instance="a", action="restart", state="failed", reason="r", started_wall_s=now - 40 * DAY_S
    )
    running = store.start_remediation(
        instance="a",
        action="restart",
        state="verifying",
        reason="r",
        started_wall_s=now - 40 * DAY_S,
    )
    audit_of_old = store.record_audit(
        wall_s=now - 1 * DAY_S,
        actor="rule",
        action="restart",
        target="a",
        decision="failed",
        reason="r",
        remediation_id=old_rem,
    )
    store.record_audit(
        wall_s=now - 31 * DAY_S, actor="rule", action="x", target="a", decision="d", reason="r"
    )
    store.save_silences(
        [
            Silence("old", labels_of({"a": "b"}), now - 2 * DAY_S),
            Silence("new", labels_of({"a": "b"}), now - 0.5 * DAY_S),
        ]
    )

    report = store.apply_retention(policy, now)

    assert (
        report.outbox_rows,
        report.audit_rows,
        report.remediation_rows,
        report.silence_rows,
    ) == (2, 1, 1, 1)
    assert [i.id for i in store.outbox.pending()] == [old_pending]
    assert store.remediation(old_rem) is None and store.remediation(running) is not None
    (kept_audit,) = store.audit_records()
    assert (kept_audit.id, kept_audit.remediation_id) == (audit_of_old, None)  # FK: SET NULL
    assert [s.silence_id for s in store.load_silences(now - 3 * DAY_S)] == ["new"]
    assert store.apply_retention(policy, now) == type(report)(0, 0, 0, 0)


def test_nested_transactions_commit_once(store: StateStore) -> None:
    with store.transaction():
        store.set_fact("a", 1, 1.0)
        with store.transaction():
            store.set_fact("b", 2, 1.0)
        with pytest.raises(RuntimeError), store.transaction():
            raise RuntimeError("inner failure, caught by the caller")
    assert (store.get_fact("a"), store.get_fact("b")) == (1, 2)


def test_the_store_belongs_to_the_thread_that_opened_it(store: StateStore) -> None:
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            store.set_fact("x", 1, 1.0)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(timeout=30)
    assert len(errors) == 1 and isinstance(errors[0], sqlite3.ProgrammingError)
    assert store.get_fact("x") is None
