"""The GPU budget, block and token counts, the context table and the utilisation bounds."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvpilot.tuner.planner import PlanInputs, feasible_bounds, make_plan
from kvpilot.tuner.planner.kv_sizing import kv_capacity, kv_geometry, largest_max_model_len
from kvpilot.tuner.planner.model_shape import load_model_shape

GIB = 1024**3
LLAMA8B = Path(__file__).parent / "configs" / "meta-llama_Meta-Llama-3-8B.json"


def test_gpu_budget_follows_vllms_subtraction() -> None:
    inputs = PlanInputs(gpu_memory_bytes=80 * GIB, gpu_memory_utilization=0.9, block_size=16)
    plan = make_plan(LLAMA8B, inputs)
    b = plan.budget
    assert b.requested_bytes == math.ceil(80 * GIB * 0.9)
    assert b.weights_bytes == 2 * 8_030_261_248
    over = b.overheads
    assert (
        over.total_bytes
        == over.non_torch_bytes + over.activation_peak_bytes + over.cuda_graph_bytes
    )
    assert b.kv_cache_memory_bytes == b.requested_bytes - b.weights_bytes - over.total_bytes
    # 32 layers * 8 KV heads * 256 * 2 bytes * 16 tokens a block
    assert plan.geometry.bytes_per_block == 131_072 * 16
    assert plan.capacity.num_blocks == b.kv_cache_memory_bytes // (131_072 * 16)
    # vLLM: kv_cache_size_tokens = int(num_blocks / cdiv(len, block) * len)
    blocks = plan.capacity.num_blocks
    assert plan.capacity.kv_cache_size_tokens == int(blocks / 512 * 8192)
    assert plan.capacity.full_requests == (blocks - 1) // 512


def test_eager_mode_drops_the_cuda_graph_estimate() -> None:
    graphs = make_plan(LLAMA8B, PlanInputs(gpu_memory_bytes=80 * GIB))
    eager = make_plan(LLAMA8B, PlanInputs(gpu_memory_bytes=80 * GIB, enforce_eager=True))
    assert graphs.budget.overheads.cuda_graph_bytes > 0
    assert eager.budget.overheads.cuda_graph_bytes == 0
    assert eager.capacity.num_blocks > graphs.capacity.num_blocks


def test_explicit_budget_ignores_the_gpu_and_the_estimates() -> None:
    plan = make_plan(LLAMA8B, PlanInputs(kv_cache_memory_bytes=10 * GIB + 12345, block_size=32))
    assert plan.budget.requested_bytes is None
    assert plan.capacity.num_blocks == (10 * GIB + 12345) // (131_072 * 32)


def test_context_table_runs_from_4k_to_the_model_maximum() -> None:
    plan = make_plan(LLAMA8B, PlanInputs(kv_cache_memory_bytes=20 * GIB, max_model_len=2048))
    lengths = [row.max_model_len for row in plan.context_table]
    assert lengths == [2048, 4096, 8192]
    for row in plan.context_table:
        assert row.blocks_per_request == math.ceil(row.max_model_len / 16)
        assert row.max_concurrency == plan.capacity.num_blocks / row.blocks_per_request
    concurrencies = [row.max_concurrency for row in plan.context_table]
    assert concurrencies == sorted(concurrencies, reverse=True)


def test_largest_max_model_len_at_a_concurrency() -> None:
    geo = kv_geometry(load_model_shape(LLAMA8B), block_size=16)
    # 1 null block + 10 requests of 100 blocks fit in 1001 blocks: 1600 tokens each.
    assert largest_max_model_len(geo, 1001, 10, limit=8192) == 1600
    assert largest_max_model_len(geo, 1000, 10, limit=8192) == 99 * 16
    assert largest_max_model_len(geo, 1001, 1, limit=8192) == 8192  # capped by the model
    assert largest_max_model_len(geo, 5, 10, limit=8192) is None


def test_start_up_check_needs_one_request_plus_the_null_block() -> None:
    geo = kv_geometry(load_model_shape(LLAMA8B), block_size=16)
    exact = 513 * geo.bytes_per_block  # 512 blocks for 8192 tokens, one null block
    assert kv_capacity(geo, exact, 8192).fits_one_request
    assert not kv_capacity(geo, exact - 1, 8192).fits_one_request


def test_too_small_kv_budget_says_by_how_much() -> None:
    plan = make_plan(LLAMA8B, PlanInputs(kv_cache_memory_bytes=100 * 2 * 1024**2))
    assert len(plan.problems) == 1
    problem = plan.problems[0]
    assert "cannot hold one request of 8192 tokens" in problem
    need, have = 513 * 2 * 1024**2, 100 * 2 * 1024**2
    assert f"short by {(need - have) / GIB:.2f} GiB" in problem
    assert "longest max_model_len that fits is 1584" in problem  # 99 blocks of 16


def test_utilisation_bounds() -> None:
    plan = make_plan(LLAMA8B, PlanInputs(gpu_memory_bytes=80 * GIB, gpu_free_bytes=60 * GIB))
    util = plan.utilization
    over = plan.budget.overheads.total_bytes
    need = plan.weights.per_rank_bytes + over + 513 * plan.geometry.bytes_per_block
    assert util.min_gpu_memory_utilization == math.ceil(need / (80 * GIB) * 10_000) / 10_000
    assert util.max_gpu_memory_utilization == 0.75  # 60 of 80 GiB free
    # The smallest utilisation really leaves room for one request.
    at_min = make_plan(
        LLAMA8B,
        PlanInputs(
            gpu_memory_bytes=80 * GIB, gpu_memory_utilization=util.min_gpu_memory_utilization
        ),
    )
    assert at_min.capacity.fits_one_request and not at_min.problems
    below = make_plan(
        LLAMA8B,
        PlanInputs(
            gpu_memory_bytes=80 * GIB,
            gpu_memory_utilization=util.min_gpu_memory_utilization - 0.002,
        ),
    )
    assert below.problems


def test_feasible_bounds_for_the_tuner() -> None:
    inputs = PlanInputs(gpu_memory_bytes=80 * GIB, gpu_free_bytes=79 * GIB, max_model_len=4096)
    bounds = feasible_bounds(LLAMA8B, inputs)
    plan = make_plan(LLAMA8B, inputs)
    assert bounds.min_gpu_memory_utilization == plan.utilization.min_gpu_memory_utilization
    assert bounds.max_gpu_memory_utilization == math.floor(79 / 80 * 10_000) / 10_000
    assert bounds.min_kv_cache_memory_bytes == (256 + 1) * plan.geometry.bytes_per_block
    requested = math.ceil(80 * GIB * bounds.max_gpu_memory_utilization)
    over = plan.budget.overheads.total_bytes
    assert bounds.max_kv_cache_memory_bytes == requested - plan.weights.per_rank_bytes - over
    assert bounds.reasons == ()


def test_bounds_when_other_processes_hold_too_much() -> None:
    inputs = PlanInputs(gpu_memory_bytes=24 * GIB, gpu_free_bytes=10 * GIB)
    bounds = feasible_bounds(LLAMA8B, inputs)
    assert bounds.max_gpu_memory_utilization == pytest.approx(10 / 24, abs=1e-4)
    assert bounds.min_gpu_memory_utilization is not None
    assert any("other processes hold 14.00 GiB" in r for r in bounds.reasons)
