"""At-least-once delivery: the outbox protocol and the worker that drains it each tick.

The outbox is persistent (the agent's SQLite store), so what was enqueued before a crash
is sent after the restart. A receiver may therefore see an event more than once, always
with the same dedup key. Ordering per notifier: once a notifier fails, the worker holds
every item for it until its backoff expires and then sends them oldest first, so a
resolved event never overtakes the firing one it follows.
"""

from __future__ import annotations

import asyncio
import logging
import random as random_module
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify.base import DeliveryError, Notifier
from kvpilot.collectors.secrets import mask_text

log = logging.getLogger(__name__)

Outcome = Literal["delivered", "retry", "deferred", "given_up"]
DEFAULT_MAX_AGE_S = 24 * 3600.0
_MAX_EXPONENT = 64  # beyond this the delay is max_s anyway; avoids float overflow


@dataclass(frozen=True, slots=True)
class OutboxItem:
    """One undelivered notification for one notifier."""

    id: int
    notifier: str
    dedup_key: str
    event: AlertEvent
    attempts: int
    next_attempt_wall_s: float
    created_wall_s: float
    last_error: str | None


class Outbox(Protocol):
    """Persistent queue of notifications, one row per (notifier, dedup key) while pending."""

    def enqueue(self, notifier: str, event: AlertEvent, now_wall_s: float) -> int:
        """Adds a row due now; while a row with the same (notifier, dedup key) is pending
        (neither delivered nor given up) returns that row's id instead. Once delivered, the
        same key may be enqueued again: that is a repeat notification."""
        ...

    def due(self, now_wall_s: float, limit: int = 100) -> list[OutboxItem]:
        """Pending rows with next_attempt <= now, oldest (created, then id) first."""
        ...

    def mark_delivered(self, item_ids: Sequence[int], now_wall_s: float) -> None:
        """The rows arrived; they leave the backlog."""
        ...

    def mark_failed(
        self,
        item_ids: Sequence[int],
        error: str,
        next_attempt_wall_s: float,
        *,
        give_up: bool = False,
    ) -> None:
        """Adds one to attempts, records the error; give_up ends the row (kept, recorded)."""
        ...

    def backlog(self) -> int:
        """Pending rows, due or not."""
        ...


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff: initial x factor^failures, capped, minus up to jitter_ratio."""

    initial_s: float = 1.0
    factor: float = 2.0
    max_s: float = 300.0
    jitter_ratio: float = 0.2

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.factor < 1 or self.max_s < self.initial_s:
            raise ValueError(f"invalid backoff {self}")
        if not 0 <= self.jitter_ratio < 1:
            raise ValueError(f"jitter_ratio must be in [0, 1), got {self.jitter_ratio}")

    def delay_s(self, failures: int, draw: float) -> float:
        """Delay after `failures` consecutive failures (0 for the first); draw is in [0, 1)."""
        exponent = min(max(failures, 0), _MAX_EXPONENT)
        base = min(self.max_s, self.initial_s * self.factor**exponent)
        return base * (1.0 - self.jitter_ratio * draw)


@dataclass(frozen=True, slots=True)
class DeliveryCount:
    """How many items of one notifier ended one pass with one outcome."""

    notifier: str
    outcome: Outcome
    items_total: int


@dataclass(frozen=True, slots=True)
class DeliveryReport:
    """One pass: counts per notifier and outcome, errors seen, the backlog afterwards."""

    counts: tuple[DeliveryCount, ...]
    errors: tuple[tuple[str, str], ...]  # (notifier, message)
    backlog_items: int | None
    backlog_reason: str | None = None
    busy: bool = False  # another pass was still running; this one did nothing

    def count(self, notifier: str, outcome: Outcome) -> int:
        return sum(
            c.items_total for c in self.counts if (c.notifier, c.outcome) == (notifier, outcome)
        )


@dataclass(slots=True)
class _NotifierState:
    failures: int = 0
    blocked_until_wall_s: float = float("-inf")
    last_error: str | None = None


class DeliveryWorker:
    """Sends due outbox items, one notifier's failure never holding up another's items."""

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
    ) -> None:
        self._outbox = outbox
        self._notifiers = dict(notifiers)
        self._clock = clock
        self._backoff = backoff or Backoff()
        self._random = random or random_module.Random().random
        self._max_age_s = max_age_s
        self._send_timeout_s = send_timeout_s
        self._batch_limit = batch_limit
        self._states = {name: _NotifierState() for name in self._notifiers}
        self._lock = asyncio.Lock()

    async def deliver_due(self) -> DeliveryReport:
        """One pass over the due items; never raises."""
        if self._lock.locked():
            return DeliveryReport((), (), None, "a pass is still running", busy=True)
        async with self._lock:
            counts: Counter[tuple[str, Outcome]] = Counter()
            errors: list[tuple[str, str]] = []
            now = self._clock()
            try:
                items = self._outbox.due(now, self._batch_limit)
            except Exception as exc:
                log.exception("outbox: reading due items failed")
                return DeliveryReport((), (("outbox", repr(exc)),), None, repr(exc))
            groups: dict[str, list[OutboxItem]] = {}
            for item in items:
                groups.setdefault(item.notifier, []).append(item)
            await asyncio.gather(
                *(
                    self._deliver_group(name, group, now, counts, errors)
                    for name, group in groups.items()
                )
            )
            try:
                backlog, reason = self._outbox.backlog(), None
            except Exception as exc:
                log.exception("outbox: counting the backlog failed")
                backlog, reason = None, repr(exc)
            report_counts = tuple(
                DeliveryCount(name, outcome, n) for (name, outcome), n in sorted(counts.items())
            )
            return DeliveryReport(report_counts, tuple(errors), backlog, reason)

    async def _deliver_group(
        self,
        name: str,
        items: list[OutboxItem],
        now: float,
        counts: Counter[tuple[str, Outcome]],
        errors: list[tuple[str, str]],
    ) -> None:
        try:
            await self._deliver_group_unguarded(name, items, now, counts, errors)
        except Exception as exc:
            # The outbox failed while recording: items stay pending and are sent again.
            log.exception("delivery: recording outcomes failed", extra={"notifier": name})
            errors.append((name, f"outbox: {exc!r}"))

    async def _deliver_group_unguarded(
        self,
        name: str,
        items: list[OutboxItem],
        now: float,
        counts: Counter[tuple[str, Outcome]],
        errors: list[tuple[str, str]],
    ) -> None:
        notifier = self._notifiers.get(name)
        if notifier is None:
            error = f"notifier {name!r} is not configured"
            self._outbox.mark_failed([i.id for i in items], error, now, give_up=True)
            counts[(name, "given_up")] += len(items)
            errors.append((name, error))
            log.warning(
                "delivery: giving up",
                extra={"notifier": name, "items": len(items), "error": mask_text(error)},
            )
            return
        state = self._states[name]
        if now < state.blocked_until_wall_s:
            # Held back so that they go after the older items that failed, in order.
            error = f"deferred behind earlier failures: {state.last_error}"
            self._fail(name, items, error, state.blocked_until_wall_s, now, counts, "deferred")
            return
        queue = list(items)
        one_by_one = False
        while queue:
            batch = queue[:1] if one_by_one else queue
            err = await self._send(notifier, batch)
            if err is None:
                self._delivered(name, batch, now, counts)
                queue = queue[len(batch) :]
                continue
            arrived = [i for i in batch if i.dedup_key in err.delivered]
            self._delivered(name, arrived, now, counts)
            queue = [i for i in queue if i.dedup_key not in err.delivered]
            errors.append((name, err.message))
            if err.retryable:
                state.last_error = err.message
                delay = self._backoff.delay_s(state.failures, self._random())
                if err.retry_after_s is not None:
                    delay = max(delay, err.retry_after_s)
                state.failures += 1
                state.blocked_until_wall_s = now + delay
                log.warning(
                    "delivery: failed, will retry",
                    extra={
                        "notifier": name,
                        "items": len(queue),
                        "error": mask_text(err.message),
                        "retry_in_s": round(delay, 3),
                    },
                )
                self._fail(name, queue, err.message, now + delay, now, counts, "retry")
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
            counts[(name, "given_up")] += len(rejected)
        state.failures = 0
        state.last_error = None

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

    def _delivered(
        self, name: str, items: Sequence[OutboxItem], now: float, counts: Counter
    ) -> None:
        if items:
            self._outbox.mark_delivered([i.id for i in items], now)
            counts[(name, "delivered")] += len(items)

    def _fail(
        self,
        name: str,
        items: Sequence[OutboxItem],
        error: str,
        next_attempt_wall_s: float,
        now: float,
        counts: Counter,
        outcome: Outcome,
    ) -> None:
        expired = [i for i in items if now - i.created_wall_s >= self._max_age_s]
        retried = [i for i in items if now - i.created_wall_s < self._max_age_s]
        if retried:
            self._outbox.mark_failed([i.id for i in retried], error, next_attempt_wall_s)
            counts[(name, outcome)] += len(retried)
        if expired:
            reason = f"gave up after {self._max_age_s:.0f} s: {error}"
            log.warning(
                "delivery: expired, giving up",
                extra={"notifier": name, "items": len(expired), "error": mask_text(error)},
            )
            self._outbox.mark_failed([i.id for i in expired], reason, now, give_up=True)
            counts[(name, "given_up")] += len(expired)
