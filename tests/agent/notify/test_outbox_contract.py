"""The `Outbox` contract, run over every implementation: the SQLite outbox and the in-memory
double (tests/fakes/outbox.py).

`outbox` gives an empty outbox of each implementation. `reopen` exists only for the
implementations whose rows outlive the process (`PERSISTENT`): each call closes the previous
opening and opens the same storage again, as a restarted agent does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import pytest

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify.delivery import Outbox, OutboxItem
from kvpilot.agent.state import StateStore
from tests.agent.notify.notify_helpers import START_WALL_S, make_event
from tests.fakes.outbox import MemoryOutbox

T = START_WALL_S
IMPLEMENTATIONS = ("sqlite", "memory")
PERSISTENT = ("sqlite",)  # rows survive closing and reopening the storage


class InspectableOutbox(Outbox, Protocol):
    """Both implementations also list every pending row (`kvpilot status` shows them)."""

    def pending(self) -> list[OutboxItem]: ...


Reopen = Callable[[], InspectableOutbox]


@pytest.fixture(params=IMPLEMENTATIONS)
def outbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[InspectableOutbox]:
    if request.param == "memory":
        yield MemoryOutbox()
        return
    with StateStore.open(tmp_path) as store:
        yield store.outbox


@pytest.fixture(params=PERSISTENT)
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Reopen]:
    assert request.param == "sqlite"
    with ExitStack() as opened:

        def open_again() -> InspectableOutbox:
            opened.close()  # the previous opening ends first, as with a restarted agent
            return opened.enter_context(StateStore.open(tmp_path)).outbox

        yield open_again


def event(n: int) -> AlertEvent:
    return make_event(instance=f"vllm-{n}", incident_id=f"inc-{n}")


def ids(items: list[OutboxItem]) -> list[int]:
    return [item.id for item in items]


# --- enqueue and due -----------------------------------------------------------------


def test_an_enqueued_event_is_due_from_now(outbox: InspectableOutbox) -> None:
    e = make_event()
    item_id = outbox.enqueue("hook", e, T)
    assert outbox.due(T - 1) == []
    (item,) = outbox.due(T)
    assert item.id == item_id
    assert (item.notifier, item.dedup_key, item.event) == ("hook", e.dedup_key, e)
    assert (item.attempts, item.created_wall_s, item.last_error) == (0, T, None)
    assert item.next_attempt_wall_s == T
    assert outbox.backlog() == 1


def test_the_event_round_trips_exactly(outbox: InspectableOutbox) -> None:
    firing = make_event(summary='a > b & ü\n"quoted"', extra_labels={"empty": ""})
    resolved = make_event(status="resolved", ends_at_wall_s=T + 1.125, summary="a > b & ü")
    outbox.enqueue("hook", firing, T)
    outbox.enqueue("hook", resolved, T + 1)
    assert [item.event for item in outbox.due(T + 1)] == [firing, resolved]


def test_every_new_row_gets_an_id_not_used_before(outbox: InspectableOutbox) -> None:
    first = outbox.enqueue("hook", event(1), T)
    outbox.mark_delivered([first], T)
    second = outbox.enqueue("hook", event(2), T)
    outbox.mark_failed([second], "HTTP 400", T, give_up=True)
    third = outbox.enqueue("hook", event(3), T)
    assert len({first, second, third}) == 3


# --- idempotency ---------------------------------------------------------------------


def test_enqueue_is_idempotent_per_notifier_while_pending(outbox: InspectableOutbox) -> None:
    e = make_event()
    first = outbox.enqueue("hook", e, T)
    assert outbox.enqueue("hook", e, T + 10) == first
    other = outbox.enqueue("slack", e, T + 10)
    assert other != first
    assert outbox.backlog() == 2
    (kept,) = [item for item in outbox.due(T + 10) if item.id == first]
    assert kept.created_wall_s == T  # the second enqueue changed nothing


def test_a_row_waiting_for_a_retry_is_still_the_pending_one(outbox: InspectableOutbox) -> None:
    e = make_event()
    first = outbox.enqueue("hook", e, T)
    outbox.mark_failed([first], "HTTP 503", T + 30)
    assert outbox.enqueue("hook", e, T + 1) == first
    (item,) = outbox.pending()
    assert (item.id, item.attempts, item.next_attempt_wall_s) == (first, 1, T + 30)


def test_distinct_events_for_one_notifier_are_distinct_rows(outbox: InspectableOutbox) -> None:
    firing = make_event()
    resolved = make_event(status="resolved")
    assert firing.dedup_key != resolved.dedup_key
    a, b = outbox.enqueue("hook", firing, T), outbox.enqueue("hook", resolved, T)
    assert a != b and outbox.backlog() == 2


def test_once_delivered_the_same_key_is_a_new_row(outbox: InspectableOutbox) -> None:
    e = make_event()
    first = outbox.enqueue("hook", e, T)
    outbox.mark_delivered([first], T + 1)
    assert outbox.backlog() == 0 and outbox.due(T + 100) == []
    repeat = outbox.enqueue("hook", e, T + 60)
    assert repeat != first
    assert ids(outbox.due(T + 60)) == [repeat]


def test_marking_twice_or_unknown_ids_is_harmless(outbox: InspectableOutbox) -> None:
    item_id = outbox.enqueue("hook", make_event(), T)
    outbox.mark_delivered([item_id], T)
    outbox.mark_delivered([item_id, 99_999], T)
    outbox.mark_failed([99_999], "x", T)
    outbox.mark_delivered([], T)
    outbox.mark_failed([], "x", T)
    assert outbox.backlog() == 0


def test_a_finished_row_never_comes_back(outbox: InspectableOutbox) -> None:
    delivered = outbox.enqueue("hook", event(1), T)
    given_up = outbox.enqueue("hook", event(2), T)
    outbox.mark_delivered([delivered], T)
    outbox.mark_failed([given_up], "HTTP 400", T, give_up=True)
    outbox.mark_failed([delivered, given_up], "late failure", T)  # a stale worker's report
    outbox.mark_delivered([given_up], T)
    assert outbox.backlog() == 0 and outbox.due(T + 1000) == [] and outbox.pending() == []


# --- ordering ------------------------------------------------------------------------


def test_due_is_oldest_first_and_limited(outbox: InspectableOutbox) -> None:
    made = [outbox.enqueue("hook", event(i), T + i) for i in range(5)]
    assert ids(outbox.due(T + 10)) == made
    assert ids(outbox.due(T + 10, limit=2)) == made[:2]
    assert ids(outbox.due(T + 2)) == made[:3]


def test_the_order_enqueued_survives_a_wall_clock_step_back(outbox: InspectableOutbox) -> None:
    """A firing event goes before its resolved one though the wall clock stepped back an hour
    between the two ticks that made them: rows keep the order they were enqueued in."""
    firing = outbox.enqueue("hook", make_event(), T + 5)
    resolved = outbox.enqueue("hook", make_event(status="resolved"), T + 5 - 3600)
    other = outbox.enqueue("hook", event(3), T + 5 - 3600)
    assert ids(outbox.due(T + 10)) == [firing, resolved, other]
    assert ids(outbox.due(T + 10, limit=1)) == [firing]
    assert ids(outbox.pending()) == [firing, resolved, other]
    assert ids(outbox.pending_of("hook")) == [firing, resolved, other]


def severe(n: int, severity: str, status: str = "firing") -> AlertEvent:
    return make_event(
        instance=f"vllm-{n}",
        incident_id=f"inc-{n}",
        status=status,  # type: ignore[arg-type]
        extra_labels={"severity": severity},
    )


def test_due_gives_critical_first_and_each_alert_in_order(outbox: InspectableOutbox) -> None:
    """A page enqueued behind more warnings than one read takes is read first; within a
    severity rows keep the order enqueued, and an alert's firing goes before its resolved."""
    warnings = [outbox.enqueue("hook", severe(n, "warning"), T) for n in range(5)]
    info = outbox.enqueue("hook", severe(5, "info"), T)
    other_page = outbox.enqueue("other", severe(6, "critical"), T)
    firing = outbox.enqueue("hook", severe(7, "critical"), T)
    unknown = outbox.enqueue("hook", severe(8, "page-me"), T)  # unknown counts as a warning
    resolved = outbox.enqueue("hook", severe(7, "critical", "resolved"), T)
    assert ids(outbox.due(T, limit=2, notifier="hook")) == [firing, resolved]
    assert ids(outbox.due(T, notifier="hook")) == [firing, resolved, *warnings, unknown, info]
    assert ids(outbox.due(T, limit=3)) == [other_page, firing, resolved]
    assert ids(outbox.pending_of("hook")) == [*warnings, info, firing, unknown, resolved]


def test_a_retried_row_keeps_its_place_ahead_of_newer_ones(outbox: InspectableOutbox) -> None:
    firing = outbox.enqueue("hook", make_event(), T)
    outbox.mark_failed([firing], "HTTP 503", T + 5)
    resolved = outbox.enqueue("hook", make_event(status="resolved"), T + 1)
    assert ids(outbox.due(T + 1)) == [resolved]  # the firing one waits for its backoff
    assert ids(outbox.due(T + 5)) == [firing, resolved]  # then goes first again


def test_pending_lists_rows_due_or_not_oldest_first(outbox: InspectableOutbox) -> None:
    a = outbox.enqueue("hook", event(1), T)
    b = outbox.enqueue("slack", event(2), T + 1)
    c = outbox.enqueue("hook", event(3), T + 2)
    outbox.mark_failed([a], "HTTP 503", T + 300)
    outbox.mark_delivered([c], T + 3)
    assert ids(outbox.pending()) == [a, b]


# --- state transitions ---------------------------------------------------------------


def test_a_failure_is_recorded_and_postpones(outbox: InspectableOutbox) -> None:
    item_id = outbox.enqueue("hook", make_event(), T)
    outbox.mark_failed([item_id], "HTTP 503", T + 4)
    assert outbox.due(T + 3.9) == []
    (item,) = outbox.due(T + 4)
    assert (item.attempts, item.last_error, item.next_attempt_wall_s) == (1, "HTTP 503", T + 4)
    outbox.mark_failed([item_id], "refused", T + 8)
    (item,) = outbox.due(T + 8)
    assert (item.attempts, item.last_error) == (2, "refused")
    assert item.created_wall_s == T
    assert outbox.backlog() == 1


def test_a_failure_marks_only_the_rows_named(outbox: InspectableOutbox) -> None:
    failed = outbox.enqueue("hook", event(1), T)
    untouched = outbox.enqueue("hook", event(2), T)
    outbox.mark_failed([failed], "HTTP 503", T + 60)
    (item,) = outbox.due(T)
    assert (item.id, item.attempts, item.last_error) == (untouched, 0, None)


def test_giving_up_ends_the_row(outbox: InspectableOutbox) -> None:
    e = make_event()
    item_id = outbox.enqueue("hook", e, T)
    kept = outbox.enqueue("hook", event(1), T)
    outbox.mark_failed([item_id], "HTTP 400", T, give_up=True)
    assert ids(outbox.due(T + 1000)) == [kept]
    assert outbox.backlog() == 1
    assert outbox.enqueue("hook", e, T + 1) not in {item_id, kept}


def test_backlog_counts_rows_not_yet_due(outbox: InspectableOutbox) -> None:
    item_id = outbox.enqueue("hook", make_event(), T)
    outbox.mark_failed([item_id], "HTTP 503", T + 300)
    assert outbox.due(T + 1) == []
    assert outbox.backlog() == 1


def test_due_of_one_notifier_leaves_the_others_out(outbox: InspectableOutbox) -> None:
    """Each notifier's due rows read apart, so that one owing thousands crowds out no other."""
    hook = [outbox.enqueue("hook", event(n), T) for n in range(3)]
    am = outbox.enqueue("am", event(9), T)
    outbox.mark_failed([hook[1]], "503", T + 60)  # held for later: not due
    assert ids(outbox.due(T + 1, notifier="am")) == [am]
    assert ids(outbox.due(T + 1, notifier="hook")) == [hook[0], hook[2]]
    assert ids(outbox.due(T + 1, limit=1, notifier="hook")) == [hook[0]]
    assert outbox.due(T + 1, notifier="nobody") == []


def test_pending_counts_and_rows_per_notifier_leave_finished_ones_out(
    outbox: InspectableOutbox,
) -> None:
    first = outbox.enqueue("hook", event(1), T)
    outbox.enqueue("am", event(2), T)
    held = outbox.enqueue("hook", event(3), T + 1)
    outbox.mark_failed([held], "503", T + 60)  # held for later: still pending
    outbox.mark_delivered([outbox.enqueue("hook", event(4), T)], T)
    outbox.mark_failed([outbox.enqueue("hook", event(5), T)], "400", T, give_up=True)
    assert outbox.pending_counts() == {"hook": 2, "am": 1}
    assert ids(outbox.pending_of("hook")) == [first, held]
    assert outbox.pending_of("nobody") == []


def test_many_rows_are_marked_at_once(outbox: InspectableOutbox) -> None:
    rows = [outbox.enqueue("hook", event(n), T) for n in range(1_500)]
    outbox.mark_failed(rows[:1_200], "503", T + 60)
    outbox.mark_delivered(rows[300:], T)
    assert ids(outbox.pending()) == rows[:300]
    assert {i.attempts for i in outbox.pending()} == {1}


def test_make_pending_due_brings_held_rows_forward_only(outbox: InspectableOutbox) -> None:
    held = outbox.enqueue("hook", event(1), T)
    outbox.mark_failed([held], "HTTP 503", T + 300)
    waiting = outbox.enqueue("hook", event(2), T + 5)  # due since T + 5: left as it is
    ended = outbox.enqueue("hook", event(3), T)
    outbox.mark_failed([ended], "HTTP 400", T, give_up=True)
    sent = outbox.enqueue("hook", event(4), T)
    outbox.mark_delivered([sent], T + 1)
    assert outbox.make_pending_due(T + 10) == 1
    assert [(i.id, i.next_attempt_wall_s) for i in outbox.due(T + 10)] == [
        (held, T + 10),
        (waiting, T + 5),
    ]
    (first, _) = outbox.pending()
    assert (first.attempts, first.last_error, first.created_wall_s) == (1, "HTTP 503", T)
    assert outbox.make_pending_due(T + 10) == 0


# --- the in-memory double's own record -----------------------------------------------


def test_the_double_tells_how_each_row_left_the_backlog() -> None:
    outbox = MemoryOutbox()
    sent = outbox.enqueue("hook", event(1), 1.0)
    rejected = outbox.enqueue("hook", event(2), 1.0)
    outbox.mark_delivered([sent], 2.0)
    outbox.mark_failed([rejected], "HTTP 400", 3.0, give_up=True)
    first, second = outbox.finished()
    assert first.delivered and first.finished_wall_s == 2.0 and first.item.id == sent
    assert not second.delivered and second.item.id == rejected
    assert (second.item.attempts, second.item.last_error) == (1, "HTTP 400")


# --- what survives a reopen (persistent implementations only) ------------------------


def test_pending_rows_survive_a_reopen(reopen: Reopen) -> None:
    outbox = reopen()
    delivered = outbox.enqueue("hook", event(1), 10.0)
    failed = outbox.enqueue("hook", event(2), 11.0)
    given_up = outbox.enqueue("hook", event(3), 12.0)
    waiting = outbox.enqueue("slack", event(4), 13.0)
    outbox.mark_delivered([delivered], 14.0)
    outbox.mark_failed([failed], "refused", 20.0)
    outbox.mark_failed([given_up], "HTTP 400", 14.0, give_up=True)
    before = outbox.pending()
    outbox = reopen()
    assert outbox.pending() == before
    assert outbox.backlog() == 2
    (item,) = outbox.due(20.0 - 0.5)
    assert item.id == waiting
    first, second = outbox.due(20.0)
    assert (first.id, first.attempts, first.last_error, first.event) == (
        failed,
        1,
        "refused",
        event(2),
    )
    assert second.id == waiting


def test_dedup_and_ids_carry_on_after_a_reopen(reopen: Reopen) -> None:
    outbox = reopen()
    pending = outbox.enqueue("hook", event(1), 10.0)
    finished = outbox.enqueue("hook", event(2), 10.0)
    outbox.mark_delivered([finished], 11.0)
    outbox = reopen()
    assert outbox.enqueue("hook", event(1), 30.0) == pending
    fresh = outbox.enqueue("hook", event(2), 30.0)
    assert fresh not in {pending, finished}
    assert ids(outbox.due(30.0)) == [pending, fresh]


def test_a_row_given_up_before_a_reopen_stays_ended(reopen: Reopen) -> None:
    outbox = reopen()
    item_id = outbox.enqueue("hook", event(1), 10.0)
    outbox.mark_failed([item_id], "HTTP 400", 10.0, give_up=True)
    outbox = reopen()
    assert outbox.backlog() == 0 and outbox.due(1e12) == []
    outbox.mark_delivered([item_id], 11.0)  # a late report changes nothing
    assert outbox.pending() == []
