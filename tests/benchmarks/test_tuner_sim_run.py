"""The simulated benchmark's harness builds the product's suggesters as the study does."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from kvpilot.agent.tuning.study import MEASURED_KV_ERROR_RATIO
from kvpilot.tuner.suggest import (
    SUGGESTERS,
    InformedSuggester,
    KneeSuggester,
    MemoryAxis,
    make_suggester,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from tuner_sim import DEV_SEEDS, draw_landscape
from tuner_sim_run import (
    OBSERVED_KV_SD,
    config_of,
    knowledge_of,
    registered_suggesters,
    space_of,
    strategies,
)


def test_every_registered_search_is_a_strategy_by_its_configuration_name() -> None:
    assert set(registered_suggesters()) == set(SUGGESTERS) - {"grid"}
    assert set(registered_suggesters()) <= set(strategies())


def test_the_landscape_knowledge_is_what_the_agent_would_give() -> None:
    """The deployed flags lie in the space; the prior is the planner's estimate in whole
    blocks (not the true knee, which errs against it); the KV knob's axis is the identity."""
    ls = draw_landscape(DEV_SEEDS[0])
    known = knowledge_of(ls)
    space = space_of(ls)
    assert all(space.knob(name).contains(value) for name, value in known.deployed.items())
    assert known.deployed["kv_cache_memory_bytes"] == ls.deployed.kv_bytes
    assert known.prior is not None and known.axis == MemoryAxis.identity()
    block = ls.geometry.bytes_per_block
    assert 0 <= known.prior.need_bytes - ls.planner_knee_bytes <= block
    assert known.prior.need_bytes % block == 0
    # The load as the study computes it for an open loop: Little's law at the inter-token
    # SLO's limit, an upper end of the batch the load needs, what the load offers, and the
    # KV a running request holds as the stable server measured it: the truth, not the
    # planner's lengths, within a drawn error that changes with the run.
    assert known.load is not None
    assert known.load.requests_in_flight == ls.target_rps * ls.output_tokens * ls.itl_slo_s
    assert known.load.requests_in_flight >= ls.need
    assert known.load.offered_tokens_per_s == ls.target_rps * ls.output_tokens
    measured = [knowledge_of(ls, seed).load for seed in range(20)]
    errors = [math.log(m.kv_bytes_per_request / ls.seq_bytes) for m in measured if m]
    assert len(set(errors)) == 20 and max(map(abs, errors)) < 4 * OBSERVED_KV_SD
    assert known.load.error_ratio == MEASURED_KV_ERROR_RATIO
    assert known.load.prompt_tokens == ls.prompt_tokens


def test_the_informed_strategy_asks_what_a_suggester_told_the_landscape_asks() -> None:
    """Its first trial is a knowing suggester's first ask, not a blind one's (the harness
    once built every suggester from the space and seed alone)."""
    ls = draw_landscape(DEV_SEEDS[0])
    known, space = knowledge_of(ls), space_of(ls)
    record = strategies()["informed"](ls, 0, lambda _c: 0.0)
    first = record.history[0][0]
    knowing = make_suggester("informed", space, 0, known)
    assert isinstance(knowing, KneeSuggester)  # it knows the load's shape
    assert first == config_of(knowing.ask())
    assert first != config_of(InformedSuggester(space, seed=0).ask())


def test_the_judges_reach_is_the_margin_it_passes_in_80_percent_of_runs() -> None:
    """The share of passes never falls as the margin grows; the 80 % margin sits above the
    fixed-sample threshold at 64 windows; a landscape's reach is at or above its noise
    floor (both regrets of the least configuration at a margin)."""
    from tuner_sim_bench import noise_floor, reach
    from tuner_sim_run import margin_passed, pass_share

    shares = [pass_share(m, trials=800) for m in (-0.02, 0.0, 0.01, 0.02, 0.04, 0.08)]
    assert shares == sorted(shares) and shares[0] < 0.05 and shares[-1] > 0.99
    margin = margin_passed(0.8)
    assert pass_share(margin) >= 0.8 > pass_share(margin - 0.001)
    assert 0.0224 < margin < 0.04  # z * sd / sqrt(64) = 0.0224: half the time at 64 windows
    ls = draw_landscape(DEV_SEEDS[0])
    assert reach(ls, margin) >= noise_floor(ls) > 0
    assert reach(ls, 0.0) == 0.0
