"""The planner's pre-flight for one memory-knob value: refused when it cannot fit.

The range comes from the planner's feasible bounds (one request of max_model_len is the
floor) and from what the machine has (the ceiling); a value outside it is refused with the
bound's reason, so no restart is tried with flags that cannot start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvpilot.tuner.planner.plan import PlanInputs, feasible_bounds

MemoryKnob = Literal["kv_cache_memory_bytes", "gpu_memory_utilization"]


@dataclass(frozen=True, slots=True)
class KnobRange:
    """The values of one memory knob that can fit; a bound is None where nothing is known."""

    knob: MemoryKnob
    low: float | None
    high: float | None
    low_reason: str = ""
    high_reason: str = ""


@dataclass(frozen=True, slots=True)
class KnobVerdict:
    """Whether `value` fits `range`, and why not."""

    value: float
    fits: bool
    reason: str


def check_knob(value: float, knob_range: KnobRange) -> KnobVerdict:
    """Refuses a value below the floor or above the ceiling; the reason names the bound."""
    low, high = knob_range.low, knob_range.high
    if value <= 0:
        return KnobVerdict(value, False, f"{knob_range.knob} {value:g} is not positive")
    if low is not None and value < low:
        why = f" ({knob_range.low_reason})" if knob_range.low_reason else ""
        return KnobVerdict(
            value, False, f"{knob_range.knob} {value:g} is below the planner's minimum {low:g}{why}"
        )
    if high is not None and value > high:
        why = f" ({knob_range.high_reason})" if knob_range.high_reason else ""
        return KnobVerdict(value, False, f"{knob_range.knob} {value:g} is above {high:g}{why}")
    return KnobVerdict(value, True, f"{knob_range.knob} {value:g} fits the planner's range")


def kv_bytes_range(
    config_json: str | Path,
    *,
    block_size: int,
    max_model_len: int | None,
    dtype: str = "auto",
    available_bytes: int | None = None,
    ceiling_bytes: int | None = None,
) -> KnobRange:
    """The --kv-cache-memory-bytes values that can start: at least one request of
    max_model_len (the planner's floor), at most what is available and the configured
    ceiling. Raises the planner's ModelShapeError or PlanError (ValueErrors) for a bad model."""
    inputs = PlanInputs(
        block_size=block_size,
        max_model_len=max_model_len,
        dtype=dtype,
        kv_cache_memory_bytes=1,  # explicit budget: the planner bounds the knob, no GPU needed
    )
    bounds = feasible_bounds(config_json, inputs)
    highs = [
        (float(v), why)
        for v, why in (
            (available_bytes, "the memory available now"),
            (ceiling_bytes, "the configured ceiling"),
        )
        if v is not None
    ]
    high, high_reason = min(highs) if highs else (None, "")
    return KnobRange(
        "kv_cache_memory_bytes",
        float(bounds.min_kv_cache_memory_bytes),
        high,
        "one request of max_model_len",
        high_reason,
    )


def utilization_range(low: float | None = None, high: float | None = None) -> KnobRange:
    """--gpu-memory-utilization's range: the planner's bounds where the GPU is known, else
    vLLM's own (0, 1]."""
    return KnobRange(
        "gpu_memory_utilization",
        low,
        1.0 if high is None else high,
        "the planner's minimum for one request" if low is not None else "",
        "the planner's largest that starts" if high is not None else "vLLM's maximum",
    )
