"""Bayesian, random and grid suggesters pass one contract; the Bayesian one's specifics."""

from __future__ import annotations

import pytest

from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.problem.space import Knob, KnobKind, SearchSpace
from kvpilot.tuner.suggest import (
    BayesianSuggester,
    GridSuggester,
    InformedSuggester,
    RandomSuggester,
    row_major_order,
    warm_start,
)
from kvpilot.tuner.suggest.bayes import MemoryTrend
from tests.tuner.suggest.contract import (
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


class TestInformed(SuggesterContract):
    @pytest.fixture
    def factory(self) -> Factory:
        return lambda space, seed: InformedSuggester(space, seed=seed)


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
        (8, 0.6),
        (8, 0.75),
        (8, 0.9),
        (16, 0.6),
    ]


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
        return TrialResult(TrialOutcome.FAILED_TO_START, None, None, "failed to start")
    seqs_term = abs(values["max_num_seqs"] - 64) / 64
    return TrialResult(
        TrialOutcome.FEASIBLE, 1000 * values["gpu_memory_utilization"] - 50 * seqs_term, None, None
    )


def test_first_points_come_from_the_safe_region() -> None:
    space = cliff_space()
    suggester = BayesianSuggester(space, seed=4, n_initial_points=4, safe_margin_ratio=0.2)
    for _ in range(4):
        candidate = suggester.ask()
        assert 0.2 - 1e-3 <= space.to_unit(candidate)[0] <= 0.8 + 1e-3
        suggester.tell(candidate, cliff(candidate.as_dict()))


def test_infeasible_trials_are_never_told_to_the_optimiser(monkeypatch) -> None:
    import skopt

    told: list[tuple[float, ...]] = []
    original = skopt.Optimizer.tell

    def spy(self, x, y, fit=True):
        told.extend(tuple(point) for point in x)
        return original(self, x, y, fit)

    monkeypatch.setattr(skopt.Optimizer, "tell", spy)
    space = cliff_space()
    suggester = BayesianSuggester(space, seed=5, pool_size=300)
    feasible: set[tuple[float, ...]] = set()
    infeasible = 0
    for _ in range(10):
        candidate = suggester.ask()
        result = cliff(candidate.as_dict())
        suggester.tell(candidate, result)
        if result.feasible:
            feasible.add(tuple(round(u, 9) for u in space.to_unit(candidate)))
        else:
            infeasible += 1
    assert told, "the optimiser was used"
    assert {tuple(round(u, 9) for u in point) for point in told} <= feasible
    assert infeasible >= 1, "the test needs an infeasible trial to mean anything"


def test_the_memory_trend_may_rise_with_the_kv_budget_but_never_fall() -> None:
    import numpy as np

    xs = np.asarray([[0.2, 0.5], [0.5, 0.1], [0.8, 0.9]])
    rising = np.asarray([-100.0, -200.0, -300.0])  # -goodput: goodput rises with memory
    trend = MemoryTrend.fit(xs, rising, axis=0)
    assert trend.slope == pytest.approx(-1000 / 3)
    assert list(trend.at(xs)) == pytest.approx(list(rising))
    falling = MemoryTrend.fit(xs, -rising, axis=0)
    assert falling.slope == 0.0
    assert list(falling.at(xs)) == pytest.approx([200.0] * 3)  # flat, at the trials' mean
    assert MemoryTrend.fit(xs, rising, axis=None).slope == 0.0  # no memory knob: flat


def test_a_rising_kv_trend_sends_the_search_to_the_memory_bound() -> None:
    """After the first points show goodput rising with memory, the next trial tries the
    largest budget the constraints allow rather than another uncertain edge."""
    space = SearchSpace(
        (
            Knob(
                "kv_cache_memory_bytes",
                KnobKind.INTEGER,
                1 << 20,
                1 << 24,
                log_scale=True,
                levels=tuple(1 << n for n in range(20, 25)),
            ),
            Knob(
                "max_num_seqs",
                KnobKind.INTEGER,
                8,
                128,
                log_scale=True,
                levels=(8, 16, 32, 64, 128),
            ),
        )
    )

    def goodput(values: dict) -> TrialResult:
        memory = space.knobs[0].to_unit(values["kv_cache_memory_bytes"])
        seqs = space.knobs[1].to_unit(values["max_num_seqs"])
        return TrialResult(
            TrialOutcome.FEASIBLE, 1000 + 1000 * memory - 200 * abs(seqs - 0.75), None, None
        )

    for seed in range(5):
        suggester = BayesianSuggester(space, seed=seed)
        for _ in range(3):  # the initial points, from the safe region
            candidate = suggester.ask()
            suggester.tell(candidate, goodput(candidate.as_dict()))
        assert suggester.ask()["kv_cache_memory_bytes"] == 1 << 24, f"seed {seed}"


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
    history.append(
        (
            {"gpu_memory_utilization": 0.7, "block_size": 16},
            result_for({"gpu_memory_utilization": 0.7, "max_num_seqs": 8}),
        )
    )
    assert warm_start(suggester, finite_space(), history) == 3
    rest = {suggester.ask() for _ in range(len(VALID_FINITE) - 3)}
    assert rest == set(VALID_FINITE[3:])
