"""Knobs, candidates, constraints and the default space."""

from __future__ import annotations

import math
import random

import pytest

from kvpilot.tuner.planner import FeasibleBounds
from kvpilot.tuner.problem.constraints import (
    batched_tokens_constraint,
    parse_constraint,
    planner_constraint,
)
from kvpilot.tuner.problem.space import Knob, KnobKind, SearchSpace, default_space, optional_knob

BOUNDS = FeasibleBounds(
    min_gpu_memory_utilization=0.62,
    max_gpu_memory_utilization=0.88,
    min_kv_cache_memory_bytes=1_081_344,
    max_kv_cache_memory_bytes=64 * 1024 * 1024,
    bytes_per_block=32768,
    reasons=(),
)


def test_log_knob_maps_its_geometric_middle_to_the_middle() -> None:
    knob = Knob("max_num_seqs", KnobKind.INTEGER, 4, 256, log_scale=True)
    assert knob.from_unit(0.5) == 32  # sqrt(4 * 256)
    assert knob.to_unit(32) == pytest.approx(0.5)
    assert knob.from_unit(0.0) == 4 and knob.from_unit(1.0) == 256
    assert knob.from_unit(1.7) == 256  # clipped


def test_real_knob_is_linear_and_rounded_to_what_is_passed() -> None:
    knob = Knob("gpu_memory_utilization", KnobKind.REAL, 0.5, 0.9)
    assert knob.from_unit(0.25) == pytest.approx(0.6)
    assert knob.from_unit(0.123456) == round(0.5 + 0.123456 * 0.4, 4)


def test_levels_snap_to_the_nearest_in_the_knobs_scale() -> None:
    knob = Knob("max_num_seqs", KnobKind.INTEGER, 2, 128, log_scale=True, levels=(2, 8, 128))
    # 0.45 of the log range is ~13.2: nearer to 8 than to 128 in log space.
    assert knob.from_unit(0.45) == 8
    assert knob.grid(10) == (2, 8, 128)
    assert knob.contains(8) and not knob.contains(9)


def test_choice_and_flag_knobs_make_their_argv() -> None:
    dtype = optional_knob("kv_cache_dtype")
    prefix = optional_knob("--enable-prefix-caching")
    assert dtype.argv("fp8") == ["--kv-cache-dtype", "fp8"]
    assert prefix.argv(True) == ["--enable-prefix-caching"]
    assert prefix.argv(False) == ["--no-enable-prefix-caching"]
    assert dtype.from_unit(0.9) == "fp8" and dtype.from_unit(0.1) == "auto"


def test_bad_knobs_are_refused() -> None:
    with pytest.raises(ValueError, match="positive low"):
        Knob("x", KnobKind.INTEGER, 0, 10, log_scale=True)
    with pytest.raises(ValueError, match="every level"):
        Knob("x", KnobKind.INTEGER, 1, 10, levels=(11,))
    with pytest.raises(ValueError, match="unknown knob"):
        optional_knob("max_model_len")


def test_candidate_argv_in_knob_order() -> None:
    space = default_space(BOUNDS, extra_knobs=(optional_knob("block_size"),))
    cand = space.candidate({"gpu_memory_utilization": 0.8, "max_num_seqs": 64, "block_size": 32})
    assert space.argv(cand) == [
        "--gpu-memory-utilization",
        "0.8",
        "--max-num-seqs",
        "64",
        "--block-size",
        "32",
    ]
    with pytest.raises(ValueError, match="outside"):
        space.candidate({"gpu_memory_utilization": 0.99, "max_num_seqs": 64, "block_size": 32})


def test_default_space_takes_its_memory_range_from_the_planner() -> None:
    gpu = default_space(BOUNDS)
    assert (gpu.knob("gpu_memory_utilization").low, gpu.knob("gpu_memory_utilization").high) == (
        0.62,
        0.88,
    )
    assert gpu.knob("max_num_seqs").log_scale
    cpu = default_space(BOUNDS, memory_knob="kv_cache_memory_bytes")
    kv = cpu.knob("kv_cache_memory_bytes")
    assert (kv.low, kv.high, kv.log_scale) == (1_081_344, 64 * 1024 * 1024, True)
    assert cpu.names == ("kv_cache_memory_bytes", "max_num_seqs")


def test_planner_constraint_names_the_bound_broken() -> None:
    check = planner_constraint(BOUNDS).check
    assert check({"gpu_memory_utilization": 0.7}) is None
    assert "too little for one request" in (check({"gpu_memory_utilization": 0.5}) or "")
    assert "more than is free" in (check({"gpu_memory_utilization": 0.95}) or "")
    assert "one request" in (check({"kv_cache_memory_bytes": 1000}) or "")


def test_batched_tokens_constraint_uses_fixed_flags_too() -> None:
    knobs = (Knob("max_num_seqs", KnobKind.INTEGER, 1, 4096),)
    space = SearchSpace(
        knobs, fixed=(("max_num_batched_tokens", 2048),), constraints=(batched_tokens_constraint(),)
    )
    assert space.violation(space.candidate({"max_num_seqs": 2048})) is None
    reason = space.violation(space.candidate({"max_num_seqs": 2049}))
    assert reason == "batched_tokens: max_num_seqs 2049 > max_num_batched_tokens 2048"


def test_user_constraint_with_a_product() -> None:
    constraint = parse_constraint("max_num_seqs * 64 <= max-num-batched-tokens")
    assert constraint.check({"max_num_seqs": 32, "max_num_batched_tokens": 2048}) is None
    assert "does not hold" in (
        constraint.check({"max_num_seqs": 33, "max_num_batched_tokens": 2048}) or ""
    )
    assert constraint.check({"max_num_seqs": 33}) is None  # the other side is unknown
    with pytest.raises(ValueError, match="no comparison"):
        parse_constraint("max_num_seqs 64")


def test_grid_is_row_major_with_the_first_name_outside() -> None:
    space = SearchSpace(
        (
            Knob("gpu_memory_utilization", KnobKind.REAL, 0.5, 0.9, levels=(0.5, 0.9)),
            Knob("max_num_seqs", KnobKind.INTEGER, 1, 100, levels=(1, 10, 100)),
        )
    )
    walked = [
        (c["max_num_seqs"], c["gpu_memory_utilization"])
        for c in space.grid(5, order=["max_num_seqs", "gpu_memory_utilization"])
    ]
    assert walked == [(1, 0.5), (1, 0.9), (10, 0.5), (10, 0.9), (100, 0.5), (100, 0.9)]


def test_safe_region_pulls_the_memory_knob_in_only() -> None:
    space = default_space(BOUNDS).safe_region(0.25)
    util = space.knob("gpu_memory_utilization")
    assert util.low == pytest.approx(0.62 + 0.25 * 0.26, abs=1e-4)
    assert util.high == pytest.approx(0.88 - 0.25 * 0.26, abs=1e-4)
    assert (space.knob("max_num_seqs").low, space.knob("max_num_seqs").high) == (1, 512)


def test_latin_hypercube_is_stratified_on_every_knob() -> None:
    space = default_space(BOUNDS, memory_knob="kv_cache_memory_bytes")
    points = space.latin_hypercube(6, random.Random(3))
    assert len(set(points)) == 6
    for axis in (0, 1):
        strata = sorted(min(5, math.floor(space.to_unit(p)[axis] * 6)) for p in points)
        assert strata == [0, 1, 2, 3, 4, 5]  # one point per sixth of each knob's range


def test_latin_hypercube_keeps_only_candidates_that_meet_the_constraints() -> None:
    space = default_space(BOUNDS, user_constraints=["max_num_seqs <= 16"])
    points = space.latin_hypercube(6, random.Random(3))
    assert len(set(points)) == 6
    assert all(p["max_num_seqs"] <= 16 for p in points)
