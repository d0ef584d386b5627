"""The suggester interface: ask for a candidate, tell it how the trial went."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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


@dataclass(frozen=True, slots=True)
class ServerObservation:
    """What a server that ran a candidate saw beside the verdict: its KV high-water mark and
    its preemptions per finished request (None where unknown)."""

    kv_high_water_bytes: int | None = None
    preemptions_per_request: float | None = None

    def __post_init__(self) -> None:
        if self.kv_high_water_bytes is not None and self.kv_high_water_bytes < 0:
            raise ValueError("kv_high_water_bytes must not be negative")
        if self.preemptions_per_request is not None and not self.preemptions_per_request >= 0:
            raise ValueError("preemptions_per_request must be a number >= 0")


@runtime_checkable
class Observing(Protocol):
    """A suggester that also learns from observations (an optional extension of ask/tell).

    `observe` may come without a `tell` for the same candidate: the stable server's own
    flags and high-water mark are told this way before the first ask.
    """

    def observe(self, candidate: Candidate, observation: ServerObservation) -> None: ...


@runtime_checkable
class Explaining(Protocol):
    """A suggester that says why it asked a candidate (what a dry run prints)."""

    def explain(self, candidate: Candidate) -> str: ...


def tell_observed(
    suggester: Suggester,
    candidate: Candidate,
    result: TrialResult,
    observation: ServerObservation | None = None,
) -> None:
    """Tell a result, and the observation to suggesters that take one (others ignore it)."""
    suggester.tell(candidate, result)
    if observation is not None and isinstance(suggester, Observing):
        suggester.observe(candidate, observation)


def objective_value(result: TrialResult) -> float | None:
    """What the optimiser maximises: goodput of a feasible trial (a tuning session tells it
    as the ratio to the trial's concurrent baseline: `relative_result`); None for infeasible
    ones."""
    if not result.feasible:
        return None
    return result.goodput_tokens_per_s


def warm_start(
    suggester: Suggester,
    space: SearchSpace,
    history: Iterable[tuple[Mapping[str, Value], TrialResult]],
) -> int:
    """Tell past (knob values, result) pairs that fit this space; returns how many were told.
    The results are told as given: a session passes them as it tells live ones
    (`kvpilot.tuner.session.told_history`)."""
    told = 0
    for values, result in history:
        try:
            candidate = space.candidate(values)
        except ValueError:
            continue  # recorded under another space (other knobs or ranges): not comparable
        suggester.tell(candidate, result)
        told += 1
    return told
