"""The suggester interface: ask for a candidate, tell it how the trial went."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from kvpilot.tuner.problem.constraints import Value
from kvpilot.tuner.problem.objective import TrialResult
from kvpilot.tuner.problem.space import Candidate, SearchSpace


class SearchExhausted(Exception):
    """The suggester has no untried candidate left that meets the constraints."""


class Suggester(Protocol):
    """Ask/tell: `ask` proposes an untried candidate that meets the space's constraints.

    `tell` accepts any candidate of the space (asked or not: history is told this way),
    feasible or infeasible; infeasible results carry no objective value.
    """

    def ask(self) -> Candidate: ...

    def tell(self, candidate: Candidate, result: TrialResult) -> None: ...


def objective_value(result: TrialResult) -> float | None:
    """What the optimiser maximises: goodput of a feasible trial; None for infeasible ones."""
    if not result.feasible:
        return None
    return result.goodput_tokens_per_s


def warm_start(
    suggester: Suggester,
    space: SearchSpace,
    history: Iterable[tuple[Mapping[str, Value], TrialResult]],
) -> int:
    """Tell past (knob values, result) pairs that fit this space; returns how many were told."""
    told = 0
    for values, result in history:
        try:
            candidate = space.candidate(values)
        except ValueError:
            continue  # recorded under another space (other knobs or ranges): not comparable
        suggester.tell(candidate, result)
        told += 1
    return told
