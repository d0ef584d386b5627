"""Waiting on a condition without reading the clock: each tick settles what it can.

A remediation that needs to know whether its alert's condition cleared (after the light
step, after a restart) registers a watch with a monotonic deadline; the agent's tick calls
`settle` with that tick's conditions and time, and the waiting coroutine wakes with the
verdict. Tests drive the ticks instead of sleeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kvpilot.agent.model import Condition

WatchVerdict = Literal["cleared", "active", "unknown", "absent"]


@dataclass(frozen=True, slots=True)
class WatchWindows:
    """How long the condition is watched after a step; fixed here, not configured."""

    # After a healthy restart: still active this long, the restart failed.
    after_restart_s: float = 120.0
    # After the light step: not cleared this long, the restart follows.
    after_light_step_s: float = 30.0

    def __post_init__(self) -> None:
        if self.after_restart_s <= 0 or self.after_light_step_s < 0:
            raise ValueError(f"watch windows must be positive: {self}")


DEFAULT_WINDOWS = WatchWindows()


@dataclass(frozen=True, slots=True)
class WatchResult:
    """How a watch ended: the verdict, and the tick's time when it did."""

    verdict: WatchVerdict
    at_s: float
    reason: str


@dataclass(slots=True)
class _Watch:
    deadline_s: float
    future: asyncio.Future[WatchResult]
    last: WatchVerdict = "absent"
    last_reason: str = "no condition reported yet"


class ConditionWatch:
    """Watches by alert fingerprint; at most one per fingerprint (one remediation at a time)."""

    def __init__(self) -> None:
        self._watches: dict[str, _Watch] = {}
        # The last tick's conditions and resolved alerts, kept as given (read rarely).
        self._last_conditions: dict[str, Condition] = {}
        self._last_resolved: frozenset[str] = frozenset()

    def latest(self, fingerprint: str) -> WatchVerdict:
        """The condition as the last tick saw it: "absent" when it reported none."""
        if fingerprint in self._last_resolved:
            return "cleared"
        condition = self._last_conditions.get(fingerprint)
        return "absent" if condition is None else _verdict(condition.active)

    def __contains__(self, fingerprint: str) -> bool:
        return fingerprint in self._watches

    async def wait(self, fingerprint: str, deadline_s: float) -> WatchResult:
        """Until a tick shows the condition inactive, or a tick at or past `deadline_s`."""
        future: asyncio.Future[WatchResult] = asyncio.get_running_loop().create_future()
        self._watches[fingerprint] = _Watch(deadline_s, future)
        try:
            return await future
        finally:
            self._watches.pop(fingerprint, None)

    def settle(
        self, conditions: Iterable[Condition], now_s: float, resolved: Iterable[str] = ()
    ) -> None:
        """One tick: `conditions` evaluated now, `resolved` fingerprints whose alert resolved."""
        by_fp = {c.fingerprint: c for c in conditions}
        gone = frozenset(resolved)
        self._last_conditions, self._last_resolved = by_fp, gone
        for fp, watch in list(self._watches.items()):
            if watch.future.done():
                continue
            condition = by_fp.get(fp)
            if fp in gone or (condition is not None and condition.active is False):
                watch.future.set_result(WatchResult("cleared", now_s, "condition inactive"))
                continue
            if condition is not None:
                if condition.active is True:
                    watch.last, watch.last_reason = "active", condition.summary
                else:
                    watch.last = "unknown"
                    watch.last_reason = condition.reason or "condition unknown"
            if now_s >= watch.deadline_s:
                watch.future.set_result(WatchResult(watch.last, now_s, watch.last_reason))


def _verdict(active: bool | None) -> WatchVerdict:
    return "unknown" if active is None else "active" if active else "cleared"
