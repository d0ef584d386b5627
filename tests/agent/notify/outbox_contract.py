"""The `Outbox` contract: every implementation's test class inherits `OutboxContract`.

A subclass provides an `outbox` fixture returning an empty outbox (and may reopen it to
test persistence on its own).
"""

from __future__ import annotations

from kvpilot.agent.notify import Outbox
from tests.agent.notify.notify_helpers import START_WALL_S, make_event

T = START_WALL_S


class OutboxContract:
    def test_an_enqueued_event_is_due_from_now(self, outbox: Outbox) -> None:
        event = make_event()
        item_id = outbox.enqueue("hook", event, T)
        assert outbox.due(T - 1) == []
        (item,) = outbox.due(T)
        assert item.id == item_id
        assert (item.notifier, item.dedup_key, item.event) == ("hook", event.dedup_key, event)
        assert (item.attempts, item.created_wall_s, item.last_error) == (0, T, None)
        assert item.next_attempt_wall_s == T
        assert outbox.backlog() == 1

    def test_the_event_round_trips_exactly(self, outbox: Outbox) -> None:
        event = make_event(status="resolved", ends_at_wall_s=T + 1.125, summary="a > b & ü")
        outbox.enqueue("hook", event, T)
        (item,) = outbox.due(T)
        assert item.event == event

    def test_enqueue_is_idempotent_per_notifier_while_pending(self, outbox: Outbox) -> None:
        event = make_event()
        first = outbox.enqueue("hook", event, T)
        assert outbox.enqueue("hook", event, T + 10) == first
        other = outbox.enqueue("slack", event, T + 10)
        assert other != first
        assert outbox.backlog() == 2

    def test_once_delivered_the_same_key_is_a_new_row(self, outbox: Outbox) -> None:
        event = make_event()
        first = outbox.enqueue("hook", event, T)
        outbox.mark_delivered([first], T + 1)
        assert outbox.backlog() == 0 and outbox.due(T + 100) == []
        repeat = outbox.enqueue("hook", event, T + 60)
        assert repeat != first
        assert [i.id for i in outbox.due(T + 60)] == [repeat]

    def test_due_is_oldest_first_and_limited(self, outbox: Outbox) -> None:
        ids = [outbox.enqueue("hook", make_event(instance=f"vllm-{i}"), T + i) for i in range(5)]
        assert [i.id for i in outbox.due(T + 10)] == ids
        assert [i.id for i in outbox.due(T + 10, limit=2)] == ids[:2]
        assert [i.id for i in outbox.due(T + 2)] == ids[:3]

    def test_a_failure_is_recorded_and_postpones(self, outbox: Outbox) -> None:
        item_id = outbox.enqueue("hook", make_event(), T)
        outbox.mark_failed([item_id], "HTTP 503", T + 4)
        assert outbox.due(T + 3.9) == []
        (item,) = outbox.due(T + 4)
        assert (item.attempts, item.last_error, item.next_attempt_wall_s) == (1, "HTTP 503", T + 4)
        outbox.mark_failed([item_id], "refused", T + 8)
        (item,) = outbox.due(T + 8)
        assert (item.attempts, item.last_error) == (2, "refused")
        assert outbox.backlog() == 1

    def test_giving_up_ends_the_row(self, outbox: Outbox) -> None:
        event = make_event()
        item_id = outbox.enqueue("hook", event, T)
        kept = outbox.enqueue("hook", make_event(instance="vllm-1"), T)
        outbox.mark_failed([item_id], "HTTP 400", T, give_up=True)
        assert [i.id for i in outbox.due(T + 1000)] == [kept]
        assert outbox.backlog() == 1
        assert outbox.enqueue("hook", event, T + 1) not in {item_id, kept}

    def test_backlog_counts_rows_not_yet_due(self, outbox: Outbox) -> None:
        item_id = outbox.enqueue("hook", make_event(), T)
        outbox.mark_failed([item_id], "HTTP 503", T + 300)
        assert outbox.due(T + 1) == []
        assert outbox.backlog() == 1

    def test_marking_unknown_ids_is_harmless(self, outbox: Outbox) -> None:
        item_id = outbox.enqueue("hook", make_event(), T)
        outbox.mark_delivered([item_id], T)
        outbox.mark_delivered([item_id, 99_999], T)
        outbox.mark_failed([99_999], "x", T)
        assert outbox.backlog() == 0
