"""At-least-once delivery: the outbox protocol and the worker that drains it each tick.

The outbox is persistent (the agent's SQLite store), so what was enqueued before a crash
is sent after the restart. A receiver may therefore see an event more than once, always
with the same dedup key.

Order matters per alert, not across alerts: the worker sends each (notifier, alert
fingerprint) as its own lane, oldest first. Once a lane fails, the worker holds that lane's
items until its backoff expires, so a resolved event never overtakes the firing one it
follows. Lanes run concurrently (a bounded number of sends per notifier) and a pass does not
wait for a slow one, so one slow or failing receiver, or alert, never holds up another. A
receiver that takes lists (Alertmanager) gets many lanes in one request (`batches`).

A lane goes one request at a time, each under its own `send_timeout_s`, and each event is
marked delivered as soon as its request succeeds: a lane that takes longer than the timeout
as a whole still moves on, instead of sending its first events again on every attempt.

Each notifier has its own share: every pass reads each notifier's due rows apart (up to
`batch_limit` of them, past those its running lanes hold) and starts its critical lanes
before its others, so a slow or down receiver owing thousands of rows holds back no other
notifier's, critical pages included.

Each notifier's backlog is bounded: past `max_pending_per_notifier` the lowest severity,
then the oldest, is dropped and counted (`shedding`).

Time is the worker's own (`SteadyTime`): backoff and the expiry after `max_age_s` run on a
steady clock, so a step of the wall clock moves neither.

The backoff belongs to the worker, not to the rows: a new worker (the agent started again)
makes every pending row due on its first pass. What it owes goes out at once, one attempt
per start, instead of waiting out up to `Backoff.max_s` that an earlier process set against
a receiver that may since have been mended.
"""

from __future__ import annotations

import asyncio
import logging
import random as random_module
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvpilot.agent.notify.backoff import Backoff
from kvpilot.agent.notify.base import DeliveryError, Notifier
from kvpilot.agent.notify.batches import Lane, LaneKey, batch_size_of, groups
from kvpilot.agent.notify.delivery_report import DeliveryCount, DeliveryOutcome, DeliveryReport
from kvpilot.agent.notify.outbox_item import Outbox, OutboxItem
from kvpilot.agent.notify.shedding import (
    DEFAULT_MAX_PENDING_PER_NOTIFIER,
    drop_reason,
    severity_rank,
    to_drop,
)
from kvpilot.agent.notify.steady_time import SteadyTime
from kvpilot.collectors.secrets import mask_text

__all__ = [
    "Backoff",
    "DeliveryCount",
    "DeliveryOutcome",
    "DeliveryReport",
    "DeliveryWorker",
    "Outbox",
    "OutboxItem",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_AGE_S = 24 * 3600.0
DEFAULT_LANES_PER_NOTIFIER = 8
DEFAULT_PASS_WAIT_S = 1.0
_MAX_READ_FACTOR = 16  # how far past batch_limit a pass reads when lanes hold the oldest rows


@dataclass(slots=True)
class _LaneState:
    """A lane's failures in a row and how long its items are held."""

    failures: int = 0
    blocked_until_wall_s: float = float("-inf")
    last_error: str | None = None


class DeliveryWorker:
    """Sends due outbox items, one lane per (notifier, alert), in order within each lane.

    A pass starts a lane for each alert with due items (unless that lane still runs), at most
    `lanes_per_notifier` at once per notifier and reading at most about `batch_limit` rows of
    each notifier, and waits up to `pass_wait_s` for them; a lane still running then goes on
    in the background and its outcomes are in a later report. `send_timeout_s` bounds each
    request (one event, or one batch for a notifier that takes batches).
    """

    def __init__(
        self,
        outbox: Outbox,
        notifiers: Mapping[str, Notifier],
        *,
        clock: Callable[[], float],
        backoff: Backoff | None = None,
        random: Callable[[], float] | None = None,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        send_timeout_s: float = 30.0,
        batch_limit: int = 100,
        lanes_per_notifier: int = DEFAULT_LANES_PER_NOTIFIER,
        pass_wait_s: float = DEFAULT_PASS_WAIT_S,
        monotonic: Callable[[], float] | None = None,
        max_pending_per_notifier: int = DEFAULT_MAX_PENDING_PER_NOTIFIER,
    ) -> None:
        if min(lanes_per_notifier, batch_limit, max_pending_per_notifier) < 1:
            raise ValueError(
                "lanes_per_notifier, batch_limit and max_pending_per_notifier must be at least 1"
            )
        self._outbox = outbox
        self._notifiers = dict(notifiers)
        self._time = SteadyTime(clock, monotonic)
        self._clock = self._time.now
        self._backoff = backoff or Backoff()
        self._random = random or random_module.Random().random
        self._max_age_s = max_age_s
        self._send_timeout_s = send_timeout_s
        self._batch_limit = batch_limit
        self._lanes_per_notifier = lanes_per_notifier
        self._pass_wait_s = pass_wait_s
        self._max_pending = max_pending_per_notifier
        self._states: dict[LaneKey, _LaneState] = {}
        self._owed_made_due = False  # the first pass makes what earlier processes held due
        # Each running lane's send and its items; lanes sent in one batch share one task.
        self._running: dict[LaneKey, tuple[asyncio.Task[None], int]] = {}
        self._counts: Counter[tuple[str, DeliveryOutcome]] = Counter()
        self._errors: list[tuple[str, str]] = []

    def use_notifiers(self, notifiers: Mapping[str, Notifier]) -> None:
        """New notifiers (a reload): the next lanes use them; running lanes finish as they are."""
        self._notifiers = dict(notifiers)
        for key in [k for k in self._states if k[0] not in self._notifiers]:
            del self._states[key]

    def lanes_running(self) -> int:
        return len(self._running)

    async def deliver_due(self) -> DeliveryReport:
        """One pass over the due items; never raises."""
        now = self._clock()
        try:
            if not self._owed_made_due:
                made_due = self._outbox.make_pending_due(now)
                self._owed_made_due = True
                if made_due:
                    log.info("delivery: %d items owed from before the start are due now", made_due)
            owing = self._shed(now)
            lanes = self._startable_lanes(owing, now)
        except Exception as exc:
            log.exception("outbox: reading due items failed")
            self._errors.append(("outbox", repr(exc)))
            return self._report(None, repr(exc))
        started = self._start_all(lanes, now)
        if started:
            await asyncio.wait(started, timeout=self._pass_wait_s)
        try:
            backlog, reason = self._outbox.backlog(), None
        except Exception as exc:
            log.exception("outbox: counting the backlog failed")
            backlog, reason = None, repr(exc)
        return self._report(backlog, reason)

    async def aclose(self, grace_s: float = 5.0) -> None:
        """Give running lanes `grace_s` to finish, then cancel them (their items stay queued)."""
        tasks = [task for task, _ in self._running.values()]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
            log.warning(
                "delivery: %d lanes still sending at shutdown; sent again on the next start",
                len(pending),
            )

    # -- lanes -------------------------------------------------------------------------

    def _startable_lanes(self, owing: Sequence[str], now: float) -> dict[LaneKey, list[OutboxItem]]:
        """The due items by lane of every notifier in `owing` with a send to spare, each
        notifier read apart so that none crowds another out."""
        lanes: dict[LaneKey, list[OutboxItem]] = {}
        for name in owing:
            if self._has_room(name):
                lanes.update(self._startable_lanes_of(name, now))
        return lanes

    def _startable_lanes_of(self, name: str, now: float) -> dict[LaneKey, list[OutboxItem]]:
        """One notifier's due items by lane, oldest first, without lanes that still run;
        reads past the rows that its running lanes hold, so that they never crowd out its
        others."""
        held = sum(n for (owner, _), (_, n) in self._running.items() if owner == name)
        limit = self._batch_limit + held
        while True:
            items = self._outbox.due(self._time.due_by(now), limit, notifier=name)
            lanes: dict[LaneKey, list[OutboxItem]] = {}
            for item in items:
                lanes.setdefault((name, item.event.fingerprint), []).append(item)
            free = {k: v for k, v in lanes.items() if k not in self._running}
            if (
                len(items) < limit
                or sum(map(len, free.values())) >= self._batch_limit
                or limit >= self._batch_limit * _MAX_READ_FACTOR
            ):
                return free
            limit *= 2

    def _has_room(self, name: str) -> bool:
        """Whether the notifier has fewer than `lanes_per_notifier` sends out (lanes sent
        together in one batch are one send)."""
        sends = {id(task) for (n, _), (task, _) in self._running.items() if n == name}
        return len(sends) < self._lanes_per_notifier

    def _start_all(
        self, lanes: Mapping[LaneKey, list[OutboxItem]], now: float
    ) -> list[asyncio.Task[None]]:
        """A task per send: one per lane, or per batch of lanes for a notifier that takes
        many events in one request."""
        ready: dict[str, list[Lane]] = {}
        for key, items in lanes.items():
            if self._settle(key, items, now):
                ready.setdefault(key[0], []).append((key, items))
        started: list[asyncio.Task[None]] = []
        for name, waiting in ready.items():
            notifier = self._notifiers[name]
            # Critical lanes first when sends are few (stable: oldest first within a severity).
            waiting.sort(key=lambda lane: severity_rank(lane[1][0]))
            for group in groups(waiting, batch_size_of(notifier)):
                if not self._has_room(name):
                    break  # the notifier has its sends out: a later pass starts the rest
                started.append(self._start(name, notifier, group))
        return started

    def _settle(self, key: LaneKey, items: list[OutboxItem], now: float) -> bool:
        """True when the lane is to be sent; False when it was settled at once (held back
        behind earlier failures, an unknown notifier) or the outbox failed meanwhile."""
        name = key[0]
        try:
            if name not in self._notifiers:
                self._give_up_unknown(name, items, now)
                return False
            state = self._states.get(key)
            if state is not None and now < state.blocked_until_wall_s:
                # Held back so that they go after the older items that failed, in order; those
                # already held until then (seen early after a wall-clock step) stay as they are.
                until = state.blocked_until_wall_s
                new = [i for i in items if i.next_attempt_wall_s < until]
                error = f"deferred behind earlier failures: {state.last_error}"
                kept = self._fail(key, new, error, until, now, "deferred")
                if len(new) == len(items) and not kept:
                    self._states.pop(key, None)  # everything it held expired
                return False
        except Exception as exc:  # the outbox failed while recording: the items stay pending
            self._outbox_failed(name, exc)
            return False
        return True

    def _start(self, name: str, notifier: Notifier, group: list[Lane]) -> asyncio.Task[None]:
        items = sorted((i for _, lane in group for i in lane), key=_oldest_first)
        task = asyncio.get_running_loop().create_task(
            self._lane(name, notifier, items), name=f"delivery {name}"
        )
        for key, lane in group:
            self._running[key] = (task, len(lane))

        def done(finished: asyncio.Task[None]) -> None:
            for key, _ in group:
                if self._running.get(key, (None, 0))[0] is finished:
                    del self._running[key]

        task.add_done_callback(done)
        return task

    async def _lane(self, name: str, notifier: Notifier, items: list[OutboxItem]) -> None:
        try:
            await self._send_lane(name, notifier, items)
        except Exception as exc:  # the outbox failed while recording: the items stay pending
            self._outbox_failed(name, exc)

    async def _send_lane(self, name: str, notifier: Notifier, items: list[OutboxItem]) -> None:
        """Sends one lane's items (or a batch of lanes' items) in order, `batch_size_of`
        the notifier per request: one event at a time for a notifier without batches, each
        under its own timeout and marked delivered as soon as it arrives."""
        size = batch_size_of(notifier)
        queue = list(items)
        one_by_one = False
        while queue:
            batch = queue[:1] if one_by_one else queue[:size]
            err = await self._send(notifier, batch)
            now = self._clock()
            if err is None:
                self._delivered(name, batch, now)
                queue = queue[len(batch) :]
                continue
            arrived = [i for i in batch if i.dedup_key in err.delivered]
            self._delivered(name, arrived, now)
            queue = [i for i in queue if i.dedup_key not in err.delivered]
            self._errors.append((name, err.message))
            if err.retryable:
                self._retry_later(name, queue, err, now)
                self._forget_lanes(name, items, keep=queue)
                return
            culprit = err.dedup_key or (batch[0].dedup_key if len(batch) == 1 else None)
            if culprit is None:
                one_by_one = True  # a rejected batch: find out which events it rejects
                continue
            rejected = [i for i in queue if i.dedup_key == culprit]
            queue = [i for i in queue if i.dedup_key != culprit]
            log.warning(
                "delivery: rejected, giving up",
                extra={"notifier": name, "dedup_key": culprit, "error": mask_text(err.message)},
            )
            self._outbox.mark_failed([i.id for i in rejected], err.message, now, give_up=True)
            self._counts[(name, "given_up")] += len(rejected)
            self._time.forget(i.id for i in rejected)
        self._forget_lanes(name, items, keep=())  # through: the lanes forget their failures

    def _forget_lanes(
        self, name: str, items: Sequence[OutboxItem], *, keep: Sequence[OutboxItem]
    ) -> None:
        """The failures of the lanes in `items` that hold nothing in `keep` are forgotten."""
        held = {i.event.fingerprint for i in keep}
        for fingerprint in {i.event.fingerprint for i in items} - held:
            self._states.pop((name, fingerprint), None)

    def _retry_later(
        self, name: str, queue: list[OutboxItem], err: DeliveryError, now: float
    ) -> None:
        """Each lane of `queue` waits out its own backoff (its failures in a row)."""
        lanes: dict[LaneKey, list[OutboxItem]] = {}
        for item in queue:
            lanes.setdefault((name, item.event.fingerprint), []).append(item)
        delays = [self._retry_lane(key, held, err, now) for key, held in lanes.items()]
        log.warning(
            "delivery: failed, will retry",
            extra={
                "notifier": name,
                "fingerprint": next(iter(lanes))[1] if len(lanes) == 1 else None,
                "lanes": len(lanes),
                "items": len(queue),
                "error": mask_text(err.message),
                "retry_in_s": round(max(delays, default=0.0), 3),
            },
        )

    def _retry_lane(
        self, key: LaneKey, held: list[OutboxItem], err: DeliveryError, now: float
    ) -> float:
        state = self._states.setdefault(key, _LaneState())
        state.last_error = err.message
        delay = self._backoff.delay_s(state.failures, self._random())
        if err.retry_after_s is not None:
            delay = max(delay, err.retry_after_s)
        state.failures += 1
        state.blocked_until_wall_s = now + delay
        if not self._fail(key, held, err.message, now + delay, now, "retry"):
            self._states.pop(key, None)  # nothing left to hold back
        return delay

    async def _send(self, notifier: Notifier, items: Sequence[OutboxItem]) -> DeliveryError | None:
        try:
            await asyncio.wait_for(
                notifier.send([i.event for i in items]), timeout=self._send_timeout_s
            )
        except DeliveryError as err:
            return err
        except TimeoutError:
            return DeliveryError(f"{notifier.name}: no answer in {self._send_timeout_s} s", True)
        except Exception as exc:
            log.exception("delivery: notifier raised", extra={"notifier": notifier.name})
            return DeliveryError(f"{notifier.name}: unexpected {type(exc).__name__}: {exc}", True)
        return None

    # -- outcomes ----------------------------------------------------------------------

    def _shed(self, now: float) -> list[str]:
        """Each notifier's backlog back to `max_pending_per_notifier` (see `shedding`); rows
        that a running lane is sending are not dropped but count against the bound. Returns
        the notifiers that owe rows."""
        counts = self._outbox.pending_counts()
        for name, count in counts.items():
            if count <= self._max_pending:
                continue
            rows = self._outbox.pending_of(name)
            free = [i for i in rows if (name, i.event.fingerprint) not in self._running]
            dropped = to_drop(free, self._max_pending - (len(rows) - len(free)))
            reason = drop_reason(name, self._max_pending)
            self._outbox.mark_failed([i.id for i in dropped], reason, now, give_up=True)
            self._counts[(name, "dropped")] += len(dropped)
            self._time.forget(i.id for i in dropped)
            gone = {i.id for i in dropped}
            self._forget_lanes(name, dropped, keep=[i for i in rows if i.id not in gone])
            log.warning(
                "delivery: outbox full, dropped notifications",
                extra={"notifier": name, "items": len(dropped), "pending": count},
            )
        return sorted(counts)

    def _give_up_unknown(self, name: str, items: Sequence[OutboxItem], now: float) -> None:
        error = f"notifier {name!r} is not configured"
        self._outbox.mark_failed([i.id for i in items], error, now, give_up=True)
        self._counts[(name, "given_up")] += len(items)
        self._time.forget(i.id for i in items)
        self._errors.append((name, error))
        log.warning(
            "delivery: giving up",
            extra={"notifier": name, "items": len(items), "error": mask_text(error)},
        )

    def _outbox_failed(self, name: str, exc: Exception) -> None:
        log.exception("delivery: recording outcomes failed", extra={"notifier": name})
        self._errors.append((name, f"outbox: {exc!r}"))

    def _delivered(self, name: str, items: Sequence[OutboxItem], now: float) -> None:
        if items:
            self._outbox.mark_delivered([i.id for i in items], now)
            self._counts[(name, "delivered")] += len(items)
            self._time.forget(i.id for i in items)

    def _fail(
        self,
        key: LaneKey,
        items: Sequence[OutboxItem],
        error: str,
        next_attempt_wall_s: float,
        now: float,
        outcome: DeliveryOutcome,
    ) -> int:
        """Items to try again at `next_attempt_wall_s`, or given up once too old; returns how
        many stay pending."""
        name = key[0]
        ages = {i.id: self._time.age_s(i.id, i.created_wall_s, now) for i in items}
        expired = [i for i in items if ages[i.id] >= self._max_age_s]
        retried = [i for i in items if ages[i.id] < self._max_age_s]
        if retried:
            self._outbox.mark_failed([i.id for i in retried], error, next_attempt_wall_s)
            self._counts[(name, outcome)] += len(retried)
        if expired:
            reason = f"gave up after {self._max_age_s:.0f} s: {error}"
            log.warning(
                "delivery: expired, giving up",
                extra={"notifier": name, "items": len(expired), "error": mask_text(error)},
            )
            self._outbox.mark_failed([i.id for i in expired], reason, now, give_up=True)
            self._counts[(name, "given_up")] += len(expired)
            self._time.forget(i.id for i in expired)
        return len(retried)

    def _report(self, backlog: int | None, reason: str | None) -> DeliveryReport:
        """The outcomes gathered since the last report; they are reported once."""
        counts = tuple(DeliveryCount(n, o, c) for (n, o), c in sorted(self._counts.items()))
        errors = tuple(self._errors)
        self._counts.clear()
        self._errors.clear()
        return DeliveryReport(counts, errors, backlog, reason)


def _oldest_first(item: OutboxItem) -> int:
    """The order enqueued (ids only grow), which a step of the wall clock cannot change."""
    return item.id
