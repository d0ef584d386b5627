"""Random search: uniform draws in each knob's scale (log knobs in their logarithm)."""

from __future__ import annotations

import random

from kvpilot.tuner.problem.objective import TrialResult
from kvpilot.tuner.problem.space import Candidate, SearchSpace
from kvpilot.tuner.suggest.base import SearchExhausted


class RandomSuggester:
    """Draws untried candidates that meet the constraints; gives up after `max_draws`."""

    def __init__(self, space: SearchSpace, seed: int = 0, max_draws: int = 2000) -> None:
        self._space = space
        self._rng = random.Random(seed)
        self._max_draws = max_draws
        self._seen: set[Candidate] = set()

    def ask(self) -> Candidate:
        for _ in range(self._max_draws):
            point = [self._rng.random() for _ in self._space.knobs]
            candidate = self._space.from_unit(point)
            if candidate not in self._seen and self._space.violation(candidate) is None:
                self._seen.add(candidate)
                return candidate
        raise SearchExhausted(f"no untried candidate in {self._max_draws} draws")

    def tell(self, candidate: Candidate, result: TrialResult) -> None:
        self._seen.add(candidate)
