"""The informed suggester on synthetic landscapes: bisection, the cliff, the floor, the
high-water mark, the trust region, the max_num_seqs ladder, and its registration."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpilot.tuner.planner import kv_geometry, load_model_shape
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.problem.space import Candidate, Knob, KnobKind, SearchSpace
from kvpilot.tuner.problem.startup_errors import StartupFailure, StartupFailureKind
from kvpilot.tuner.suggest import (
    BayesianSuggester,
    InformedSuggester,
    Knowledge,
    KvPrior,
    SearchExhausted,
    ServerObservation,
    make_suggester,
    tell_observed,
)

MIB = 1 << 20
LLAMA8B = Path(__file__).parents[1] / "configs" / "meta-llama_Meta-Llama-3-8B.json"
Landscape = Callable[[Candidate], TrialResult]


def kv_space() -> SearchSpace:
    return SearchSpace(
        (
            Knob("kv_cache_memory_bytes", KnobKind.INTEGER, MIB, 64 * MIB, log_scale=True),
            Knob("max_num_seqs", KnobKind.INTEGER, 1, 512, log_scale=True),
        )
    )


def plateau(need_bytes: float, cliff_bytes: float = 48 * MIB) -> Landscape:
    """Holds the SLO from `need_bytes` up; fails to start above `cliff_bytes`."""

    def result(candidate: Candidate) -> TrialResult:
        memory = float(candidate["kv_cache_memory_bytes"])
        if memory > cliff_bytes:
            return TrialResult(
                TrialOutcome.FAILED_TO_START,
                None,
                int(memory),
                "failed to start",
                startup_failure=StartupFailure(StartupFailureKind.OUT_OF_MEMORY, "oom", None),
            )
        if memory < need_bytes:
            return TrialResult(TrialOutcome.PREEMPTED, 10.0, int(memory), "preempted")
        return TrialResult(TrialOutcome.FEASIBLE, 100.0, int(memory), None)

    return result


def run(suggester: InformedSuggester, landscape: Landscape, trials: int) -> list[Candidate]:
    asked = []
    for _ in range(trials):
        candidate = suggester.ask()
        asked.append(candidate)
        suggester.tell(candidate, landscape(candidate))
    return asked


def memory(candidate: Candidate) -> float:
    return float(candidate["kv_cache_memory_bytes"])


def test_it_never_asks_above_a_failed_start() -> None:
    space = kv_space()
    landscape = plateau(need_bytes=6 * MIB, cliff_bytes=24 * MIB)
    suggester = InformedSuggester(space, deployed={"kv_cache_memory_bytes": 40 * MIB})
    failed: list[float] = []
    for _ in range(16):
        candidate = suggester.ask()
        assert memory(candidate) < min(failed, default=math.inf)
        result = landscape(candidate)
        suggester.tell(candidate, result)
        if result.outcome is TrialOutcome.FAILED_TO_START:
            failed.append(memory(candidate))
    assert failed[0] == 40 * MIB, "the deployed budget, above the cliff, is tried first"


def test_a_start_refused_for_too_little_memory_is_a_floor() -> None:
    space = kv_space()
    suggester = InformedSuggester(space)
    floor = space.candidate({"kv_cache_memory_bytes": 4 * MIB, "max_num_seqs": 23})
    suggester.tell(
        floor,
        TrialResult.failed_to_start(
            "ValueError: To serve at least one request with the model's max seq len (1024)"
        ),
    )
    for candidate in run(suggester, plateau(need_bytes=6 * MIB), 12):
        assert memory(candidate) > 4 * MIB


def test_bisection_halves_the_bracket_in_the_knobs_scale() -> None:
    space = kv_space()
    knob = space.knob("kv_cache_memory_bytes")
    suggester = InformedSuggester(space, deployed={"max_num_seqs": 64})
    landscape = plateau(need_bytes=5 * MIB)
    for held in (2 * MIB, 32 * MIB):
        candidate = space.candidate({"kv_cache_memory_bytes": held, "max_num_seqs": 64})
        suggester.tell(candidate, landscape(candidate))
    low, high = knob.to_unit(2 * MIB), knob.to_unit(32 * MIB)
    for _ in range(5):
        candidate = suggester.ask()
        assert candidate["max_num_seqs"] == 64
        u = knob.to_unit(candidate["kv_cache_memory_bytes"])
        assert u == pytest.approx((low + high) / 2, abs=1e-5)
        result = landscape(candidate)
        suggester.tell(candidate, result)
        low, high = (low, u) if result.feasible else (u, high)
    assert 5 * MIB <= knob.from_unit(high) <= 5 * MIB * 1.05  # 1/32 of 4 octaves: 9 %


@pytest.mark.parametrize("prior_error", [-0.3, -0.15, 0.0, 0.15, 0.3])
def test_with_the_planners_prior_eight_trials_find_the_least_memory_within_five_percent(
    prior_error: float,
) -> None:
    need = 9.3 * MIB
    prior = KvPrior(round(need * (1 + prior_error)))
    suggester = InformedSuggester(kv_space(), prior=prior, deployed={"max_num_seqs": 64})
    landscape = plateau(need)
    asked = run(suggester, landscape, 8)
    held = [memory(c) for c in asked if landscape(c).feasible]
    assert held and min(held) <= need * 1.05


def test_the_high_water_mark_narrows_the_first_ask() -> None:
    space = kv_space()
    deployed = {"kv_cache_memory_bytes": 32 * MIB, "max_num_seqs": 64}
    stable = space.candidate(deployed)
    blind = InformedSuggester(space, deployed=deployed, trust_radius=0.5)
    assert memory(blind.ask()) == 32 * MIB
    informed = InformedSuggester(space, deployed=deployed, trust_radius=0.5)
    informed.observe(
        stable, ServerObservation(kv_high_water_bytes=10 * MIB, preemptions_per_request=0)
    )
    assert memory(informed.ask()) == pytest.approx(11 * MIB, rel=1e-3)  # plus the 10 % margin
    preempted = InformedSuggester(space, deployed=deployed, trust_radius=0.5)
    preempted.observe(
        stable, ServerObservation(kv_high_water_bytes=10 * MIB, preemptions_per_request=2)
    )
    assert memory(preempted.ask()) == 32 * MIB, "a server that preempted was short of memory"


def test_the_trust_region_keeps_the_first_asks_near_the_deployed_memory() -> None:
    space = kv_space()
    knob = space.knob("kv_cache_memory_bytes")
    deployed = {"kv_cache_memory_bytes": 32 * MIB, "max_num_seqs": 64}
    suggester = InformedSuggester(space, deployed=deployed, trust_radius=0.1)
    stable = space.candidate(deployed)
    suggester.observe(
        stable, ServerObservation(kv_high_water_bytes=2 * MIB, preemptions_per_request=0)
    )
    first = suggester.ask()
    assert knob.to_unit(first["kv_cache_memory_bytes"]) == pytest.approx(
        knob.to_unit(32 * MIB) - 0.1, abs=1e-5
    )
    suggester.tell(first, plateau(need_bytes=3 * MIB)(first))
    second = suggester.ask()  # a success doubles the radius
    assert knob.to_unit(second["kv_cache_memory_bytes"]) >= knob.to_unit(32 * MIB) - 0.2 - 1e-5
    assert memory(second) < memory(first)


def test_a_feasible_trials_high_water_mark_is_the_next_probe() -> None:
    space = kv_space()
    suggester = InformedSuggester(space, deployed={"max_num_seqs": 64})
    held = space.candidate({"kv_cache_memory_bytes": 32 * MIB, "max_num_seqs": 64})
    tell_observed(
        suggester,
        held,
        plateau(need_bytes=5 * MIB)(held),
        ServerObservation(kv_high_water_bytes=5 * MIB, preemptions_per_request=0),
    )
    assert memory(suggester.ask()) == pytest.approx(5.5 * MIB, rel=1e-3)


def test_a_miss_that_memory_did_not_cause_moves_max_num_seqs_down() -> None:
    """An inter-token SLO that a large batch breaks: no preemptions, KV half used."""
    space = kv_space()
    deployed = {"kv_cache_memory_bytes": 32 * MIB, "max_num_seqs": 128}
    suggester = InformedSuggester(space, deployed=deployed)
    first = suggester.ask()
    assert first == space.candidate(deployed)
    tell_observed(
        suggester,
        first,
        TrialResult(TrialOutcome.SLO_BROKEN, 50.0, 32 * MIB, "inter-token p95 0.9 s > 0.5 s"),
        ServerObservation(kv_high_water_bytes=16 * MIB, preemptions_per_request=0),
    )
    assert suggester.ask()["max_num_seqs"] == 64


def test_max_num_seqs_is_searched_after_memory_and_only_for_a_saving() -> None:
    space = kv_space()

    def by_seqs(candidate: Candidate) -> TrialResult:
        need = 8 * MIB if candidate["max_num_seqs"] >= 64 else 6 * MIB  # a smaller cap saves
        return plateau(need)(candidate)

    suggester = InformedSuggester(
        space, deployed={"kv_cache_memory_bytes": 16 * MIB, "max_num_seqs": 64}
    )
    asked = run(suggester, by_seqs, 14)
    seqs = [c["max_num_seqs"] for c in asked]
    first_other = next(i for i, s in enumerate(seqs) if s != 64)
    assert first_other >= 4, "memory first, at the deployed max_num_seqs"
    assert seqs[first_other] == 32, "then lower first, a factor of two"
    best = min((c for c in asked if by_seqs(c).feasible), key=memory)
    assert memory(best) <= 6 * MIB * 1.05 and best["max_num_seqs"] <= 32


def test_the_screening_hint_marks_probes_below_a_budget_that_held() -> None:
    space = kv_space()
    suggester = InformedSuggester(space, deployed={"max_num_seqs": 64})
    held = space.candidate({"kv_cache_memory_bytes": 32 * MIB, "max_num_seqs": 64})
    assert not suggester.screening_hint(held).screen
    suggester.tell(held, plateau(need_bytes=5 * MIB)(held))
    probe = suggester.ask()
    hint = suggester.screening_hint(probe)
    assert hint.screen and hint.windows > 0
    assert not suggester.screening_hint(held).screen


def test_it_says_exhausted_when_only_candidates_above_the_cliff_are_left() -> None:
    space = SearchSpace(
        (
            Knob(
                "kv_cache_memory_bytes",
                KnobKind.INTEGER,
                MIB,
                8 * MIB,
                log_scale=True,
                levels=(MIB, 2 * MIB, 4 * MIB, 8 * MIB),
            ),
        )
    )
    suggester = InformedSuggester(space, deployed={"kv_cache_memory_bytes": 2 * MIB})
    asked = run(suggester, plateau(need_bytes=MIB, cliff_bytes=1.5 * MIB), 2)
    assert [memory(c) for c in asked] == [2 * MIB, MIB]
    with pytest.raises(SearchExhausted):
        suggester.ask()


def test_the_prior_comes_from_the_planners_geometry_in_whole_blocks() -> None:
    geometry = kv_geometry(load_model_shape(LLAMA8B), block_size=16)
    prior = KvPrior.from_planner(geometry, tokens_in_flight=1000.5)
    assert prior.need_bytes == 63 * geometry.bytes_per_block
    assert prior.need_bytes == 63 * 16 * 128 * 1024  # 32 layers, 8 KV heads of 128, bf16
    with pytest.raises(ValueError, match="tokens_in_flight"):
        KvPrior.from_planner(geometry, tokens_in_flight=0)


def test_suggesters_are_registered_by_name() -> None:
    space = kv_space()
    known = Knowledge(prior=KvPrior(8 * MIB), deployed={"max_num_seqs": 32})
    assert isinstance(make_suggester("informed", space, 0, known), InformedSuggester)
    assert isinstance(make_suggester("bayes", space), BayesianSuggester)
    with pytest.raises(ValueError, match="known: bayes, grid, informed, random"):
        make_suggester("annealing", space)


def test_observations_go_only_to_suggesters_that_take_them() -> None:
    space = kv_space()
    candidate = space.candidate({"kv_cache_memory_bytes": 8 * MIB, "max_num_seqs": 8})
    result = plateau(need_bytes=MIB)(candidate)
    bayes = BayesianSuggester(space)
    tell_observed(bayes, candidate, result, ServerObservation(kv_high_water_bytes=MIB))
    with pytest.raises(ValueError, match="negative"):
        ServerObservation(kv_high_water_bytes=-1)
