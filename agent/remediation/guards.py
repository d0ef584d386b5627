"""The guards in front of a restart: cooldown, budget and circuit breaker, per instance.

Each guard answers with a `GuardDecision` (allowed or not, and why) for the audit record.
Times are monotonic seconds from the remediator's injected clock; the breaker's state is
exported as wall time for the journal (`to_fact` / `from_fact`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True, slots=True)
class GuardDecision:
    """One guard's answer: `allowed`, and the reason written to the audit log."""

    guard: str
    allowed: bool
    reason: str


class Cooldown:
    """At least `cooldown_s` between two actions on one instance."""

    def __init__(self, cooldown_s: float) -> None:
        self.cooldown_s = cooldown_s
        self._last_s: dict[str, float] = {}

    def check(self, instance: str, now_s: float) -> GuardDecision:
        last = self._last_s.get(instance)
        if last is None:
            return GuardDecision("cooldown", True, "no earlier action on this instance")
        elapsed = now_s - last
        if elapsed >= self.cooldown_s:
            return GuardDecision(
                "cooldown",
                True,
                f"last action {elapsed:.0f} s ago (cooldown {self.cooldown_s:g} s)",
            )
        return GuardDecision(
            "cooldown",
            False,
            f"cooldown: last action {elapsed:.0f} s ago, next allowed in "
            f"{self.cooldown_s - elapsed:.0f} s",
        )

    def record(self, instance: str, now_s: float) -> None:
        previous = self._last_s.get(instance)
        self._last_s[instance] = now_s if previous is None else max(previous, now_s)


class RestartBudget:
    """At most `max_restarts` restarts of one instance in any sliding `window_s`."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._restarts_s: dict[str, deque[float]] = {}

    def _recent(self, instance: str, now_s: float) -> deque[float]:
        stamps = self._restarts_s.setdefault(instance, deque())
        while stamps and now_s - stamps[0] >= self.window_s:
            stamps.popleft()
        return stamps

    def used(self, instance: str, now_s: float) -> int:
        return len(self._recent(instance, now_s))

    def check(self, instance: str, now_s: float) -> GuardDecision:
        stamps = self._recent(instance, now_s)
        window = f"{self.window_s:g} s"
        if len(stamps) < self.max_restarts:
            return GuardDecision(
                "budget", True, f"{len(stamps)} of {self.max_restarts} restarts used in {window}"
            )
        if not stamps:
            return GuardDecision("budget", False, "budget: restarts are disabled (budget 0)")
        frees_in = self.window_s - (now_s - stamps[0])
        return GuardDecision(
            "budget",
            False,
            f"budget exhausted: {len(stamps)} of {self.max_restarts} restarts used in {window}, "
            f"next one frees in {frees_in:.0f} s",
        )

    def record(self, instance: str, now_s: float) -> None:
        stamps = self._recent(instance, now_s)
        stamps.append(now_s)
        # Restored stamps may arrive out of order.
        if len(stamps) > 1 and stamps[-2] > now_s:
            self._restarts_s[instance] = deque(sorted(stamps))

    def seed(self, instance: str, stamps_s: Iterable[float], now_s: float) -> None:
        """Restarts a previous run made (from the journal), as monotonic stamps."""
        for stamp in sorted(stamps_s):
            if now_s - stamp < self.window_s:
                self.record(instance, stamp)


@dataclass(frozen=True, slots=True)
class BreakerChange:
    """The breaker opened or closed (a page to send or to resolve)."""

    instance: str
    to_state: BreakerState
    failures: int
    reason: str


class CircuitBreaker:
    """Counts failed restarts in a row per instance; opens at `failures_to_open`.

    Open: no restarts. With `open_for_s` set it half-opens after that long and lets one
    restart through; that restart's success closes it, its failure opens it again.
    Unset: it stays open until `reset`.
    """

    def __init__(self, failures_to_open: int, open_for_s: float | None) -> None:
        self.failures_to_open = failures_to_open
        self.open_for_s = open_for_s
        self._failures: dict[str, int] = {}
        self._opened_at_s: dict[str, float] = {}
        self._half_open: set[str] = set()

    def state(self, instance: str, now_s: float) -> BreakerState:
        opened = self._opened_at_s.get(instance)
        if opened is None:
            return "closed"
        if instance in self._half_open or (
            self.open_for_s is not None and now_s - opened >= self.open_for_s
        ):
            return "half_open"
        return "open"

    def failures(self, instance: str) -> int:
        return self._failures.get(instance, 0)

    def check(self, instance: str, now_s: float) -> GuardDecision:
        state = self.state(instance, now_s)
        failures = self.failures(instance)
        if state == "closed":
            return GuardDecision(
                "circuit_breaker",
                True,
                f"closed: {failures} of {self.failures_to_open} failed restarts in a row",
            )
        if state == "half_open":
            if instance in self._half_open:
                return GuardDecision(
                    "circuit_breaker", False, "half-open: its trial restart is still on watch"
                )
            return GuardDecision(
                "circuit_breaker", True, "half-open: one trial restart allowed after the hold"
            )
        held = "until an operator resets it"
        if self.open_for_s is not None:
            left = self.open_for_s - (now_s - self._opened_at_s[instance])
            held = f"half-opens in {left:.0f} s"
        return GuardDecision(
            "circuit_breaker",
            False,
            f"circuit open after {failures} failed restarts in a row ({held})",
        )

    def note_attempt(self, instance: str, now_s: float) -> None:
        """A restart is going through; in half-open it is the single trial."""
        if self.state(instance, now_s) == "half_open":
            self._half_open.add(instance)

    def record_failure(self, instance: str, now_s: float, reason: str) -> BreakerChange | None:
        """One failed restart; returns the change when this failure opens the breaker."""
        failures = self._failures[instance] = self.failures(instance) + 1
        state = self.state(instance, now_s)
        if state == "half_open" or (state == "closed" and failures >= self.failures_to_open):
            self._opened_at_s[instance] = now_s
            self._half_open.discard(instance)
            return BreakerChange(instance, "open", failures, reason)
        return None

    def record_success(self, instance: str, now_s: float) -> BreakerChange | None:
        """A restart kept the condition away; returns the change when it closes the breaker."""
        self._failures[instance] = 0
        if self.state(instance, now_s) == "half_open" and instance in self._half_open:
            return self._close(instance, "trial restart after the hold succeeded")
        return None

    def reset(self, instance: str, reason: str) -> BreakerChange | None:
        """Close the breaker now (an operator's call); None when it was not open."""
        self._failures[instance] = 0
        if instance not in self._opened_at_s:
            return None
        return self._close(instance, reason)

    def _close(self, instance: str, reason: str) -> BreakerChange:
        self._opened_at_s.pop(instance, None)
        self._half_open.discard(instance)
        self._failures[instance] = 0
        return BreakerChange(instance, "closed", 0, reason)

    def to_fact(self, instance: str, now_s: float, now_wall_s: float) -> dict[str, Any]:
        """The instance's breaker as JSON-able facts, stamps in wall time."""
        opened = self._opened_at_s.get(instance)
        return {
            "failures": self.failures(instance),
            "opened_at_wall_s": None if opened is None else now_wall_s - (now_s - opened),
            "trial_in_flight": instance in self._half_open,
        }

    def restore(self, instance: str, fact: dict[str, Any], now_s: float, now_wall_s: float) -> None:
        """Load what `to_fact` wrote in a previous run."""
        self._failures[instance] = int(fact.get("failures") or 0)
        opened_wall = fact.get("opened_at_wall_s")
        if opened_wall is not None:
            self._opened_at_s[instance] = now_s - (now_wall_s - float(opened_wall))
            # A trial that was in flight when the agent died is not on watch any more.
            self._half_open.discard(instance)
