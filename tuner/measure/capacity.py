"""Capacity at the SLO: the highest open-loop arrival rate a configuration serves within it.

Goodput measured on one closed burst is the time to drain that burst, not what users mean.
A configuration's capacity is instead found on Poisson arrivals: windows at a ladder of rates
`step` apart (1.5x), up from `start_rps` while the rate holds and down while it does not,
then `refinements` bisections (geometric) of the bracket. A rate holds when at least the
SLO's attainment target of its requests (95 %) meet the SLO's TTFT and inter-token limits
(`objective.attains`) and none fails.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvpilot.tuner.load.generator import LoadReport
from kvpilot.tuner.problem.objective import Slo, attains

# Measures one window of open-loop arrivals at the given rate (requests per second).
MeasureAt = Callable[[float], Awaitable[LoadReport]]


@dataclass(frozen=True, slots=True)
class RateWindow:
    """One window at one arrival rate, and whether the rate held."""

    rate_rps: float
    requests: int
    met: int
    failed: int
    holds: bool


@dataclass(frozen=True, slots=True)
class Capacity:
    """The highest rate that held (None: not even the lowest tried), every window measured,
    and the first rate found not to hold above it."""

    rate_rps: float | None
    windows: tuple[RateWindow, ...]
    failed_at_rps: float | None

    @property
    def server_windows(self) -> int:
        return len(self.windows)


def judge_window(rate_rps: float, report: LoadReport, slo: Slo) -> RateWindow:
    """Whether one window at `rate_rps` held the SLO."""
    met = sum(1 for r in report.results if attains(r, slo))
    failed = len(report.failed)
    total = len(report.results)
    holds = total > 0 and failed == 0 and met >= slo.attainment_target_ratio * total
    return RateWindow(rate_rps, total, met, failed, holds)


async def capacity_at_slo(
    measure: MeasureAt,
    slo: Slo,
    *,
    start_rps: float,
    step: float = 1.5,
    refinements: int = 2,
    max_ladder: int = 10,
) -> Capacity:
    """The ladder, then the bisections (see the module docstring)."""
    if not start_rps > 0 or math.isinf(start_rps) or step <= 1:
        raise ValueError("the ladder needs a positive start rate and a step above 1")
    windows: list[RateWindow] = []

    async def holds(rate: float) -> bool:
        window = judge_window(rate, await measure(rate), slo)
        windows.append(window)
        return window.holds

    rate = start_rps
    if await holds(rate):
        low, high = rate, None
        for _ in range(max_ladder):
            rate *= step
            if not await holds(rate):
                high = rate
                break
            low = rate
    else:
        low, high = None, rate
        for _ in range(max_ladder):
            rate /= step
            if await holds(rate):
                low = rate
                break
            high = rate
    if low is not None and high is not None:
        for _ in range(refinements):
            middle = math.sqrt(low * high)
            if await holds(middle):
                low = middle
            else:
                high = middle
    return Capacity(low, tuple(windows), high)
