"""The memory knob's step after an out-of-memory death, and the planner's pre-flight."""

from __future__ import annotations

import pytest

from kvpilot.agent.config.remediation import OomConfig
from kvpilot.agent.remediation.oom.step import KnobStep, NoStep, memory_knob, parse_bytes, plan_step
from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.rig.server import TINY_MODEL_DIR
from kvpilot.tuner.oom import GIB, MIB, OomDirection, OomSource, OomVerdict
from kvpilot.tuner.planner.preflight import (
    KnobRange,
    check_knob,
    kv_bytes_range,
    utilization_range,
)

ARGV = ("python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m")
BIG = OomVerdict(OomDirection.TOO_BIG, OomSource.OOM_KILLER, "killed by the OOM killer")
SMALL = OomVerdict(OomDirection.TOO_SMALL, OomSource.LOG, "too small")
WIDE = KnobRange("kv_cache_memory_bytes", 1 * MIB, 64 * GIB, "one request", "available")


def kv(value: int | str) -> tuple[str, ...]:
    return (*ARGV, "--kv-cache-memory-bytes", str(value))


def test_byte_counts_as_vllm_takes_them() -> None:
    assert parse_bytes("4294967296") == 4 * GIB
    assert parse_bytes("4Gi") == 4 * GIB
    assert parse_bytes("4G") == 4 * 10**9
    assert parse_bytes("512MiB") == 512 * MIB
    assert parse_bytes("lots") is None


def test_the_knob_is_the_explicit_kv_budget_else_the_utilisation() -> None:
    assert memory_knob(kv("1Gi")).value == GIB  # type: ignore[union-attr]
    util = memory_knob((*ARGV, "--gpu-memory-utilization", "0.8"))
    assert util.knob == "gpu_memory_utilization" and util.value == 0.8  # type: ignore[union-attr]
    default = memory_knob(ARGV)
    assert default.value == 0.9 and not default.explicit  # type: ignore[union-attr]
    assert isinstance(memory_knob(kv("lots")), NoStep)


def test_too_big_steps_to_what_was_available_less_the_headroom() -> None:
    said = OomVerdict(OomDirection.TOO_BIG, OomSource.LOG, "over", None, 100 * GIB, 20 * GIB)
    step = plan_step(kv(100 * GIB), said, OomConfig(headroom_ratio=0.1), WIDE)
    assert isinstance(step, KnobStep)
    assert step.new_value == (int(18 * GIB) // MIB) * MIB  # 20 GiB less 10 %, whole MiB
    assert flag_value(step.argv, "--kv-cache-memory-bytes") == str(int(step.new_value))
    assert "was" in step.reason and "available" in step.reason


def test_without_figures_the_configured_ratio_or_bytes() -> None:
    step = plan_step(kv(8 * GIB), BIG, OomConfig(step_ratio=0.25), WIDE)
    assert isinstance(step, KnobStep) and step.new_value == 6 * GIB
    by_bytes = plan_step(kv(8 * GIB), BIG, OomConfig(step_bytes=GIB), WIDE)
    assert isinstance(by_bytes, KnobStep) and by_bytes.new_value == 7 * GIB


def test_the_ceiling_holds_the_step() -> None:
    ceiling = KnobRange("kv_cache_memory_bytes", MIB, 64 * MIB, "one request", "the ceiling")
    step = plan_step(kv(4096 * GIB), BIG, OomConfig(), ceiling)
    assert isinstance(step, KnobStep) and step.new_value == 64 * MIB
    assert "the ceiling" in step.reason


def test_the_utilisation_steps_down_by_the_ratio() -> None:
    step = plan_step(
        (*ARGV, "--gpu-memory-utilization", "0.9"),
        BIG,
        OomConfig(step_ratio=0.1),
        utilization_range(),
    )
    assert isinstance(step, KnobStep) and step.new_value == pytest.approx(0.81)
    assert flag_value(step.argv, "--gpu-memory-utilization") == "0.81"


def test_too_small_steps_up_to_the_planners_minimum_and_never_down() -> None:
    step = plan_step(kv(MIB // 2), SMALL, OomConfig(headroom_ratio=0.1), WIDE)
    assert isinstance(step, KnobStep) and step.new_value >= 1.1 * MIB > MIB // 2
    off = plan_step(kv(MIB // 2), SMALL, OomConfig(step_up=False), WIDE)
    assert isinstance(off, NoStep) and "reported only" in off.reason
    above = plan_step(kv(8 * GIB), SMALL, OomConfig(), WIDE)
    assert isinstance(above, NoStep)  # already above the minimum: no step, least of all down


def test_too_small_with_no_room_above_is_reported() -> None:
    tight = KnobRange("kv_cache_memory_bytes", 10 * MIB, 8 * MIB, "one request", "available")
    step = plan_step(kv(MIB), SMALL, OomConfig(), tight)
    assert isinstance(step, NoStep) and "pre-flight refused" in step.reason


def test_the_pre_flight_refuses_out_of_range_values() -> None:
    assert not check_knob(0.5 * MIB, WIDE).fits
    assert "below the planner's minimum" in check_knob(0.5 * MIB, WIDE).reason
    assert not check_knob(65 * GIB, WIDE).fits
    assert not check_knob(0, WIDE).fits
    assert check_knob(GIB, WIDE).fits


def test_the_planners_floor_for_the_tiny_model_is_one_request() -> None:
    found = kv_bytes_range(
        TINY_MODEL_DIR / "config.json",
        block_size=32,
        max_model_len=1024,
        dtype="bfloat16",
        available_bytes=GIB,
        ceiling_bytes=64 * MIB,
    )
    # 2 layers x K and V x 2 heads x 64 x 2 bytes = 1 KiB a token: 1024 tokens and more.
    assert found.low is not None and MIB <= found.low < 4 * MIB
    assert (found.high, found.high_reason) == (64 * MIB, "the configured ceiling")


def test_config_refuses_both_step_kinds() -> None:
    with pytest.raises(ValueError, match="not both"):
        OomConfig(step_ratio=0.3, step_bytes=MIB)
