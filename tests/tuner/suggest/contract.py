"""The contract every suggester passes (imported by test_suggesters.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpilot.tuner.problem.constraints import parse_constraint
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.problem.space import Knob, KnobKind, SearchSpace
from kvpilot.tuner.suggest import SearchExhausted, Suggester

Factory = Callable[[SearchSpace, int], Suggester]


def finite_space() -> SearchSpace:
    """3 x 4 levels, minus the cells the user constraint forbids (seqs 64 with the most memory)."""
    return SearchSpace(
        (
            Knob("gpu_memory_utilization", KnobKind.REAL, 0.6, 0.9, levels=(0.6, 0.75, 0.9)),
            Knob("max_num_seqs", KnobKind.INTEGER, 8, 64, log_scale=True, levels=(8, 16, 32, 64)),
        ),
        constraints=(parse_constraint("max_num_seqs * gpu_memory_utilization < 57"),),
    )


def continuous_space() -> SearchSpace:
    return SearchSpace(
        (
            Knob("gpu_memory_utilization", KnobKind.REAL, 0.5, 0.95),
            Knob("max_num_seqs", KnobKind.INTEGER, 1, 512, log_scale=True),
        ),
        constraints=(parse_constraint("max_num_seqs <= 256"),),
    )


def result_for(values: dict) -> TrialResult:
    """A made-up landscape: feasible below 0.85 utilisation, goodput peaks at 32 sequences."""
    if values["gpu_memory_utilization"] > 0.85:
        return TrialResult(TrialOutcome.FAILED_TO_START, None, None, "failed to start: too much")
    goodput = 100.0 * values["gpu_memory_utilization"] - abs(values["max_num_seqs"] - 32)
    return TrialResult(TrialOutcome.FEASIBLE, goodput, None, None)


VALID_FINITE = [
    c for c in finite_space().grid(1) if finite_space().violation(c) is None
]  # 11 cells: (0.9, 64) is forbidden


class SuggesterContract:
    """Subclass with a `factory` fixture returning (space, seed) -> suggester."""

    def test_asks_only_valid_candidates_of_the_space(self, factory: Factory) -> None:
        space = continuous_space()
        suggester = factory(space, 0)
        for _ in range(8):
            candidate = suggester.ask()
            assert space.candidate(candidate.as_dict()) == candidate
            assert space.violation(candidate) is None
            suggester.tell(candidate, result_for(candidate.as_dict()))

    def test_walks_a_finite_space_without_repeats_then_says_exhausted(
        self, factory: Factory
    ) -> None:
        space = finite_space()
        suggester = factory(space, 1)
        asked = []
        for _ in range(len(VALID_FINITE)):
            candidate = suggester.ask()
            asked.append(candidate)
            suggester.tell(candidate, result_for(candidate.as_dict()))
        assert sorted(asked, key=str) == sorted(VALID_FINITE, key=str)
        with pytest.raises(SearchExhausted):
            suggester.ask()

    def test_same_seed_same_sequence(self, factory: Factory) -> None:
        runs = []
        for _ in range(2):
            suggester = factory(continuous_space(), 7)
            seq = []
            for _ in range(6):
                candidate = suggester.ask()
                seq.append(candidate)
                suggester.tell(candidate, result_for(candidate.as_dict()))
            runs.append(seq)
        assert runs[0] == runs[1]

    def test_told_history_is_never_asked_again(self, factory: Factory) -> None:
        space = finite_space()
        history = VALID_FINITE[:6]
        suggester = factory(space, 2)
        for candidate in history:
            suggester.tell(candidate, result_for(candidate.as_dict()))
        rest = [suggester.ask() for _ in range(len(VALID_FINITE) - len(history))]
        assert set(rest) == set(VALID_FINITE) - set(history)

    def test_ask_without_tell_does_not_repeat(self, factory: Factory) -> None:
        suggester = factory(finite_space(), 3)
        asked = [suggester.ask() for _ in range(4)]
        assert len(set(asked)) == 4
