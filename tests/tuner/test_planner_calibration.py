"""Prediction against recorded and constructed `vllm:cache_config_info` labels."""

from __future__ import annotations

import math
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.rig.server import TINY_MODEL_DIR
from kvpilot.tuner.planner import (
    PlanInputs,
    calibrate,
    make_plan,
    parse_cache_config_labels,
    predict_from_cache_config,
)

GIB = 1024**3
FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm"
LLAMA8B = Path(__file__).parent / "configs" / "meta-llama_Meta-Llama-3-8B.json"


def recorded_labels(name: str) -> list[tuple[tuple[str, str], ...]]:
    """Label sets of every engine's cache_config_info in a recorded /metrics payload."""
    text = (FIXTURES / name).read_text()
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            return [tuple(sorted(s.labels.items())) for s in family.samples]
    raise AssertionError(f"{name} has no cache_config_info")


def test_labels_parse_with_none_as_missing() -> None:
    live = parse_cache_config_labels(
        [("num_gpu_blocks", "1024"), ("kv_cache_memory_bytes", "None"), ("block_size", "x")]
    )
    assert live.num_gpu_blocks == 1024
    assert live.kv_cache_memory_bytes is None
    assert live.block_size is None
    assert live.kv_cache_size_tokens is None


def test_recorded_tiny_llama_server_agrees_exactly() -> None:
    (labels,) = recorded_labels("v0_32_idle.prom")
    result = predict_from_cache_config(TINY_MODEL_DIR, labels)
    # tiny-llama: 2 layers * 2 KV heads * (64 + 64) * 2 bytes * 32 tokens = 32 KiB a block
    assert result.predicted_num_blocks == 33_554_432 // (32 * 1024) == result.live_num_blocks
    assert result.max_model_len == 1024
    assert result.max_model_len_source.startswith("inferred")
    assert result.blocks_difference == 0 and result.tokens_difference == 0
    assert result.exact and result.warning is None and result.likely_cause is None
    assert "predicted 1024 blocks, server reports 1024 (diff +0, +0.0%)" in result.summary


def test_data_parallel_engines_sum_their_blocks() -> None:
    engines = recorded_labels("v0_32_dp2_under_load.prom")
    assert len(engines) == 2
    result = predict_from_cache_config(TINY_MODEL_DIR, engines[0], data_parallel_size=2)
    assert result.predicted_num_blocks == 2 * 1024 == result.live_num_blocks
    assert result.tokens_difference == 0
    assert result.warning is None


def test_exact_mismatch_names_the_settings() -> None:
    (labels,) = recorded_labels("v0_32_idle.prom")
    # Same budget and block size, but a model with twice the layers: half the blocks.
    result = predict_from_cache_config(
        LLAMA8B, labels, max_model_len=1024
    )  # an 8B config against the tiny server's labels
    assert result.exact
    assert result.blocks_difference == result.live_num_blocks - result.predicted_num_blocks != 0
    assert result.warning is not None
    assert "settings differ from the plan" in (result.likely_cause or "")


def _gpu_labels(blocks: int, utilization: float = 0.9) -> list[tuple[str, str]]:
    return [
        ("num_gpu_blocks", str(blocks)),
        ("block_size", "16"),
        ("cache_dtype", "auto"),
        ("gpu_memory_utilization", str(utilization)),
        ("kv_cache_memory_bytes", "None"),
        ("kv_cache_size_tokens", str(int(blocks / 512 * 8192))),
        ("kv_cache_max_concurrency", str(blocks / 512)),
        ("num_gpu_blocks_override", "None"),
    ]


def test_small_gpu_difference_is_tolerated() -> None:
    plan = make_plan(LLAMA8B, PlanInputs(gpu_memory_bytes=80 * GIB))
    live = parse_cache_config_labels(_gpu_labels(plan.capacity.num_blocks - 100))
    result = calibrate(plan, live)
    assert not result.exact
    assert result.blocks_difference == -100
    assert math.isclose(result.blocks_ratio or 0, 1 - 100 / plan.capacity.num_blocks)
    assert result.warning is None  # within 5 %
    block = plan.geometry.bytes_per_block
    expected_overhead = plan.budget.requested_bytes - plan.budget.weights_bytes
    expected_overhead -= (plan.capacity.num_blocks - 100) * block
    assert result.implied_overhead_bytes == expected_overhead
    assert result.estimated_overhead_bytes == plan.budget.overheads.total_bytes


def test_cuda_graph_shortfall_is_named() -> None:
    # On a 24 GiB GPU a gap of 1.5x the graph estimate is past the 5 % warning line.
    small = make_plan(LLAMA8B, PlanInputs(gpu_memory_bytes=24 * GIB))
    graphs = small.budget.overheads.cuda_graph_bytes
    missing_blocks = math.ceil(1.5 * graphs / small.geometry.bytes_per_block)
    blocks = small.capacity.num_blocks
    assert missing_blocks / blocks > 0.05
    result = calibrate(small, parse_cache_config_labels(_gpu_labels(blocks - missing_blocks)))
    assert result.warning is not None
    assert (result.likely_cause or "").startswith("CUDA graphs")


def test_large_shortfall_is_the_activation_peak() -> None:
    plan = make_plan(LLAMA8B, PlanInputs(gpu_memory_bytes=24 * GIB))
    blocks = plan.capacity.num_blocks
    result = calibrate(plan, parse_cache_config_labels(_gpu_labels(blocks // 2)))
    assert (result.likely_cause or "").startswith("activation peak")
    assert "max_num_batched_tokens" in (result.likely_cause or "")


def test_another_process_is_named_when_it_explains_the_gap() -> None:
    plan = make_plan(LLAMA8B, PlanInputs(gpu_memory_bytes=24 * GIB))
    blocks = plan.capacity.num_blocks
    gap = (blocks // 2) * plan.geometry.bytes_per_block
    result = calibrate(
        plan,
        parse_cache_config_labels(_gpu_labels(blocks - blocks // 2)),
        gpu_used_by_others_bytes=gap,
    )
    assert (result.likely_cause or "").startswith("another process")


def test_more_blocks_than_planned_means_overestimated_overheads() -> None:
    plan = make_plan(LLAMA8B, PlanInputs(gpu_memory_bytes=24 * GIB))
    result = calibrate(plan, parse_cache_config_labels(_gpu_labels(plan.capacity.num_blocks * 2)))
    assert (result.likely_cause or "").startswith("overheads smaller than estimated")


def test_missing_block_count_says_why() -> None:
    plan = make_plan(LLAMA8B, PlanInputs(gpu_memory_bytes=80 * GIB))
    result = calibrate(plan, parse_cache_config_labels([("block_size", "16")]))
    assert result.live_num_blocks is None and result.blocks_difference is None
    assert "no num_gpu_blocks" in result.summary
