"""Memory is priced, measured from the server, and a promotion needs more than noise."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvpilot.collectors.vllm_parse import VllmScrape, parse_vllm_metrics
from kvpilot.tuner.judge.judgement import Classification, Judgement
from kvpilot.tuner.problem.objective import (
    Slo,
    TrialOutcome,
    TrialResult,
    best_index,
    server_kv_budget_bytes,
)
from kvpilot.tuner.rollout.canary import RolloutSettings
from kvpilot.tuner.rollout.decide import promotion_decision

FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm"
MIB = 1 << 20
PASS = Judgement(Classification.PASS, 1.0, (), "score 100%")


def feasible(goodput: float, memory: int | None) -> TrialResult:
    return TrialResult(TrialOutcome.FEASIBLE, goodput, memory, None)


def scrape(name: str) -> VllmScrape:
    text = (FIXTURES / name).read_text()
    return VllmScrape(1.0, 1.0, parse_vllm_metrics(text, taken_at_s=1.0, wall_time_s=1.0), None)


def test_the_best_is_the_least_memory_within_five_percent_of_the_best_goodput() -> None:
    results = [feasible(100.0, 64 * MIB), feasible(97.0, 8 * MIB), feasible(90.0, 2 * MIB)]
    assert best_index(results, Slo()) == 1  # 3 % less goodput for an eighth of the memory
    # Unknown memory is never the cheapest: it ranks after every known one.
    assert best_index([feasible(100.0, None), feasible(96.0, 32 * MIB)], Slo()) == 1
    assert best_index([feasible(100.0, None), feasible(94.0, 32 * MIB)], Slo()) == 0


def test_the_memory_is_the_kv_budget_the_server_reports() -> None:
    one = scrape("v0_32_under_load.prom")
    (engine,) = one.engines
    assert dict(engine.cache_config)["kv_cache_memory_bytes"] == "33554432"
    assert server_kv_budget_bytes([one]) == 32 * MIB
    # Two data-parallel engines, each with its own budget.
    assert server_kv_budget_bytes([scrape("v0_32_dp2_under_load.prom")]) == 64 * MIB
    # A budget set by --gpu-memory-utilization reads "None": unknown, not zero.
    unset = dataclasses.replace(
        engine, cache_config=(*engine.cache_config, ("kv_cache_memory_bytes", "None"))
    )
    assert server_kv_budget_bytes([dataclasses.replace(one, engines=(unset,))]) is None
    assert server_kv_budget_bytes([]) is None


def decide(candidate: TrialResult, stable: TrialResult) -> tuple[bool, str]:
    return promotion_decision(candidate, stable, PASS, RolloutSettings())


def test_a_gain_inside_one_windows_noise_does_not_promote() -> None:
    # 4 % more goodput, same memory: one window a side cannot tell that from noise.
    promote, why = decide(feasible(104.0, 32 * MIB), feasible(100.0, 32 * MIB))
    assert not promote, why
    promote, why = decide(feasible(108.0, None), feasible(100.0, None))
    assert not promote, why


def test_a_gain_beyond_the_stated_margin_promotes_and_says_so() -> None:
    promote, why = decide(feasible(115.0, 32 * MIB), feasible(100.0, 32 * MIB))
    assert promote
    assert why.endswith("goodput +15%, beyond the 10% one window a side tells from noise")


def test_less_memory_at_equal_goodput_promotes() -> None:
    settings = RolloutSettings(min_memory_saving_bytes=16 * MIB)  # a CPU rig's own minimum
    promote, why = promotion_decision(
        feasible(97.0, 8 * MIB), feasible(100.0, 32 * MIB), PASS, settings
    )
    assert promote and why.endswith("75% less memory at goodput -3%"), why
    promote, why = promotion_decision(
        feasible(90.0, 8 * MIB), feasible(100.0, 32 * MIB), PASS, settings
    )
    assert not promote, why  # a tenth less goodput is not paid for by memory
