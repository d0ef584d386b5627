"""Bayesian, random and grid suggesters pass one contract; the Bayesian one's specifics."""

from __future__ import annotations

import pytest

from kvpilot.tuner.objective import Outcome, TrialResult
from kvpilot.tuner.space import Knob, KnobKind, SearchSpace
from kvpilot.tuner.suggest import (
    BayesianSuggester,
    GridSuggester,
    RandomSuggester,
    row_major_order,
    warm_start,
)

from .suggester_contract import (
    VALID_FINITE,
    Factory,
    SuggesterContract,
    finite_space,
    result_for,
)


class TestBayesian(SuggesterContract):
    @pytest.fixture
    def factory(self) -> Factory:
        return lambda space, seed: BayesianSuggester(space, seed=seed, pool_size=300)


class TestRandom(SuggesterContract):
    @pytest.fixture
    def factory(self) -> Factory:
        return lambda space, seed: RandomSuggester(space, seed=seed)


class TestGrid(SuggesterContract):
    @pytest.fixture
    def factory(self) -> Factory:
        return lambda space, seed: GridSuggester(space, points_per_knob=4)


def test_grid_walks_max_num_seqs_outside_and_memory_inside() -> None:
    space = finite_space()
    assert row_major_order(space) == ["max_num_seqs", "gpu_memory_utilization"]
    suggester = GridSuggester(space)
    walked = [suggester.ask() for _ in range(4)]
    assert [(c["max_num_seqs"], c["gpu_memory_utilization"]) for c in walked] == [
        (8, 0.6), (8, 0.75), (8, 0.9), (16, 0.6),
    ]  # fmt: skip


def cliff_space() -> SearchSpace:
    return SearchSpace(
        (
            Knob("gpu_memory_utilization", KnobKind.REAL, 0.5, 0.95),
            Knob("max_num_seqs", KnobKind.INTEGER, 1, 512, log_scale=True),
        )
    )


def cliff(values: dict) -> TrialResult:
    """Goodput grows with memory up to a cliff at 0.8 where vLLM no longer starts."""
    if values["gpu_memory_utilization"] > 0.8:
        return TrialResult(Outcome.FAILED_TO_START, None, None, "failed to start")
    seqs_term = abs(values["max_num_seqs"] - 64) / 64
    return TrialResult(Outcome.FEASIBLE, 1000 * values["gpu_memory_utilization"] - 50 * seqs_term,
                       None, None)  # fmt: skip


def test_first_points_come_from_the_safe_region() -> None:
    space = cliff_space()
    suggester = BayesianSuggester(space, seed=4, n_initial_points=4, safe_margin_ratio=0.2)
    for _ in range(4):
        candidate = suggester.ask()
        assert 0.2 - 1e-3 <= space.to_unit(candidate)[0] <= 0.8 + 1e-3
        suggester.tell(candidate, cliff(candidate.as_dict()))


def test_infeasible_trials_are_never_told_to_the_optimiser(monkeypatch) -> None:
    import skopt

    told: list[float] = []
    original = skopt.Optimizer.tell

    def spy(self, x, y, fit=True):
        told.extend(y if isinstance(y, list) else [y])
        return original(self, x, y, fit)

    monkeypatch.setattr(skopt.Optimizer, "tell", spy)
    suggester = BayesianSuggester(cliff_space(), seed=5, pool_size=300)
    goodputs: set[float] = set()
    infeasible = 0
    for _ in range(10):
        candidate = suggester.ask()
        result = cliff(candidate.as_dict())
        suggester.tell(candidate, result)
        if result.feasible:
            goodputs.add(-(result.goodput_tokens_per_s or 0.0))
        else:
            infeasible += 1
    assert told, "the optimiser was used"
    assert set(told) <= goodputs
    assert infeasible >= 1, "the test needs an infeasible trial to mean anything"


def test_the_feasibility_model_learns_a_memory_cliff_across_the_other_knob() -> None:
    space = cliff_space()
    suggester = BayesianSuggester(space, seed=0)
    # Failures over 0.8 utilisation at three max_num_seqs values, successes below it.
    for util, seqs in ((0.85, 2), (0.9, 40), (0.82, 300), (0.6, 4), (0.7, 100), (0.75, 16)):
        candidate = space.candidate({"gpu_memory_utilization": util, "max_num_seqs": seqs})
        suggester.tell(candidate, cliff(candidate.as_dict()))
    high, low = (
        space.to_unit(space.candidate({"gpu_memory_utilization": u, "max_num_seqs": 200}))
        for u in (0.93, 0.6)
    )
    p_high, p_low = suggester._feasibility([high, low])
    assert p_high < 0.2 < 0.8 < p_low


def test_warm_start_tells_only_history_that_fits_the_space() -> None:
    suggester = BayesianSuggester(finite_space(), seed=0)
    history = [(c.as_dict(), result_for(c.as_dict())) for c in VALID_FINITE[:3]]
    history.append(({"gpu_memory_utilization": 0.7, "block_size": 16}, result_for({
        "gpu_memory_utilization": 0.7, "max_num_seqs": 8})))  # fmt: skip
    assert warm_start(suggester, finite_space(), history) == 3
    rest = {suggester.ask() for _ in range(len(VALID_FINITE) - 3)}
    assert rest == set(VALID_FINITE[3:])
