"""Cumulative Prometheus histograms: reset-aware differences and ``histogram_quantile()``."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Histogram:
    """A classic histogram: cumulative counts per upper bound ``le``, sorted, ending with +Inf."""

    buckets: tuple[tuple[float, float], ...]  # (upper bound le, cumulative count)
    sum: float
    count: float

    @property
    def bounds(self) -> tuple[float, ...]:
        """The upper bounds, in order."""
        return tuple(le for le, _ in self.buckets)


def delta(newer: Histogram, older: Histogram) -> Histogram:
    """The increase from ``older`` to ``newer``.

    Reset-aware as Prometheus counters are: if any count went down (or the bucket layout
    changed, as after a restart with other buckets), the newer histogram is the increase.
    """
    if len(newer.buckets) != len(older.buckets) or newer.count < older.count:
        return newer
    out = []
    for (le_new, c_new), (le_old, c_old) in zip(newer.buckets, older.buckets, strict=True):
        if le_new != le_old or c_new < c_old:
            return newer
        out.append((le_new, c_new - c_old))
    # A sum may go down legitimately only with negative observations; latency and token
    # histograms never have them, so the plain difference is kept.
    return Histogram(buckets=tuple(out), sum=newer.sum - older.sum, count=newer.count - older.count)


def add(a: Histogram, b: Histogram) -> Histogram | None:
    """The bucket-wise sum of two histograms with the same layout; None when layouts differ."""
    if len(a.buckets) != len(b.buckets):
        return None
    out = []
    for (le_a, c_a), (le_b, c_b) in zip(a.buckets, b.buckets, strict=True):
        if le_a != le_b:
            return None
        out.append((le_a, c_a + c_b))
    return Histogram(buckets=tuple(out), sum=a.sum + b.sum, count=a.count + b.count)


def quantile(q: float, h: Histogram) -> float | None:
    """The q-quantile with Prometheus ``histogram_quantile()`` semantics.

    Linear interpolation inside the bucket; the lowest bucket starts at 0 when its bound is
    positive; a quantile in the +Inf bucket gives the highest finite bound. Where Prometheus
    answers NaN (no observations, no +Inf bucket, fewer than two buckets, q is NaN) this
    returns None; q < 0 and q > 1 give -Inf and +Inf as Prometheus does.
    """
    if math.isnan(q):
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    if not h.buckets:
        return None
    buckets = sorted(h.buckets, key=lambda b: b[0])
    if buckets[-1][0] != math.inf:
        return None
    bounds, counts = _coalesce(buckets)
    _correct_precision(counts, 1e-12)
    _ensure_monotonic(counts)
    if len(bounds) < 2:
        return None
    observations = counts[-1]
    if observations == 0:
        return None
    rank = q * observations
    b = _search(counts, rank)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0
    end = bounds[b]
    count = counts[b]
    if b > 0:
        start = bounds[b - 1]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    if count == 0:
        return None  # 0/0: Prometheus gives NaN here
    return start + (end - start) * (rank / count)


def _coalesce(buckets: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Merge buckets with the same upper bound (input sorted)."""
    bounds: list[float] = []
    counts: list[float] = []
    for le, c in buckets:
        if bounds and bounds[-1] == le:
            counts[-1] += c
        else:
            bounds.append(le)
            counts.append(c)
    return bounds, counts


def _correct_precision(counts: list[float], tolerance: float) -> None:
    """Flatten float noise that would make counts look non-monotonic (as Prometheus does)."""
    prev = counts[0]
    for i in range(1, len(counts)):
        curr = counts[i]
        diff = abs(curr - prev)
        if diff == 0:
            continue
        if curr != 0 and diff / curr <= tolerance:
            counts[i] = prev
        else:
            prev = curr


def _ensure_monotonic(counts: list[float]) -> None:
    """Raise any count below an earlier one to the running maximum."""
    top = counts[0]
    for i in range(1, len(counts)):
        if counts[i] > top:
            top = counts[i]
        elif counts[i] < top:
            counts[i] = top


def _search(counts: list[float], rank: float) -> int:
    """The first index i < len-1 with counts[i] >= rank, else len-1 (Go's sort.Search)."""
    lo, hi = 0, len(counts) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if counts[mid] >= rank:
            hi = mid
        else:
            lo = mid + 1
    return lo
