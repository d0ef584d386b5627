"""Exhaustive grid, row-major: max_num_seqs is the outer loop, the memory knob the inner.

That is the order vLLM's `benchmarks/auto_tune` script walks its two knobs (max_num_seqs
outside, the other knob inside), so the replay benchmark compares against what people run.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.tuner.problem.objective import TrialResult
from kvpilot.tuner.problem.space import MEMORY_KNOBS, Candidate, SearchSpace
from kvpilot.tuner.suggest.base import SearchExhausted


def row_major_order(space: SearchSpace) -> list[str]:
    """max_num_seqs, then the memory knob, then the other knobs in the space's order."""
    first = [n for n in ("max_num_seqs", *MEMORY_KNOBS) if n in space.names]
    return first + [n for n in space.names if n not in first]


class GridSuggester:
    """Walks every grid point once (`points_per_knob` for knobs without levels)."""

    def __init__(
        self, space: SearchSpace, points_per_knob: int = 5, order: Sequence[str] | None = None
    ) -> None:
        self._space = space
        self._points = space.grid(points_per_knob, order or row_major_order(space))
        self._next = 0
        self._seen: set[Candidate] = set()

    def ask(self) -> Candidate:
        while self._next < len(self._points):
            candidate = self._points[self._next]
            self._next += 1
            if candidate not in self._seen and self._space.violation(candidate) is None:
                self._seen.add(candidate)
                return candidate
        raise SearchExhausted(f"all {len(self._points)} grid points done")

    def tell(self, candidate: Candidate, result: TrialResult) -> None:
        self._seen.add(candidate)
