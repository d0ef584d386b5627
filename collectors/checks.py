"""Every outside value checked at the edge: what cannot be true becomes unknown with a reason.

A source builds each sample through a ``SampleChecks``: a value that is not finite, outside its
range, negative where it counts things, or contradicted by another figure or by a duplicate
series becomes None, and the refusal (field, reason, what was read) travels with the sample
so the agent can count it by reason. A rule never sees such a number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal, get_args

from kvpilot.collectors.histogram import Histogram

InvalidReason = Literal[
    "non_finite",  # NaN, +Inf or -Inf where a number was expected
    "out_of_range",  # a ratio outside 0..1, a size of zero
    "negative",  # a counter or a count below zero
    "not_integer",  # a count with a fraction
    "duplicate_series",  # the same series twice with different values (Prometheus refuses it)
    "contradictory",  # figures that cannot all be true (longest free run above the free blocks)
]

INVALID_REASONS: frozenset[str] = frozenset(get_args(InvalidReason))


def same_reading(a: float, b: float) -> bool:
    """Two readings of one series agree (NaN agrees with NaN: it is refused on its own)."""
    return a == b or (a != a and b != b)


@dataclass(frozen=True, slots=True)
class Refused:
    """One value refused at the edge: the sample's field, why, and what was read."""

    field: str
    reason: InvalidReason
    detail: str


class SampleChecks:
    """Collects the refusals while one sample is built; each check returns the value or None."""

    __slots__ = ("refused",)

    def __init__(self) -> None:
        self.refused: list[Refused] = []

    def refuse(self, field: str, reason: InvalidReason, detail: str) -> None:
        self.refused.append(Refused(field, reason, detail))

    def done(self) -> tuple[Refused, ...]:
        return tuple(self.refused)

    def finite(self, field: str, value: float | None) -> float | None:
        """Any finite number."""
        if value is None or math.isfinite(value):
            return value
        self.refuse(field, "non_finite", f"{field} is {value}")
        return None

    def ratio(self, field: str, value: float | None) -> float | None:
        """A finite number in 0..1."""
        value = self.finite(field, value)
        if value is None or 0.0 <= value <= 1.0:
            return value
        self.refuse(field, "out_of_range", f"{field} {value:g} is outside 0..1")
        return None

    def counter(self, field: str, value: float | None) -> float | None:
        """A finite number of at least zero (counters, ages, timestamps)."""
        value = self.finite(field, value)
        if value is None or value >= 0.0:
            return value
        self.refuse(field, "negative", f"{field} is {value:g}")
        return None

    def count(self, field: str, value: float | None, *, least: int = 0) -> int | None:
        """A whole number of things, at least `least`."""
        value = self.counter(field, value)
        if value is None:
            return None
        if not value.is_integer():
            self.refuse(field, "not_integer", f"{field} {value:g} is not a whole number")
            return None
        if value < least:
            self.refuse(field, "out_of_range", f"{field} {value:g} is below {least}")
            return None
        return int(value)

    def histogram(self, field: str, h: Histogram | None) -> Histogram | None:
        """Finite bounds and counts, counts that never go down, `count` equal to the +Inf bucket."""
        if h is None:
            return None
        counts = [c for _, c in h.buckets]
        if any(math.isnan(le) for le, _ in h.buckets) or not all(
            map(math.isfinite, (*counts, h.sum, h.count))
        ):
            self.refuse(field, "non_finite", f"{field} has a bucket, sum or count not finite")
            return None
        if min(*counts, h.count) < 0:
            self.refuse(field, "negative", f"{field} has a negative bucket or count")
            return None
        if any(b < a for a, b in pairwise(counts)) or h.count != counts[-1]:
            self.refuse(
                field,
                "contradictory",
                f"{field}'s cumulative buckets go down or its count {h.count:g} differs from "
                f"its +Inf bucket {counts[-1]:g}",
            )
            return None
        return h
