"""The step of the memory knob after an out-of-memory death: its new value and argv.

Too big steps down: to what the log says was available less the headroom, else by the
configured bytes or ratio, never above the range's ceiling. Too small steps up to the
planner's minimum plus the headroom, where that fits, and never down. Either way the
planner's pre-flight refuses a value that cannot fit, and the refusal is the answer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.agent.config.remediation import OomConfig
from kvpilot.collectors.vllm_argv import flag_value, set_flag
from kvpilot.tuner.oom import MIB, OomDirection, OomVerdict
from kvpilot.tuner.planner.preflight import KnobRange, MemoryKnob, check_knob

KV_FLAG = "--kv-cache-memory-bytes"
UTIL_FLAG = "--gpu-memory-utilization"
DEFAULT_UTILIZATION = 0.9  # vLLM's default where the argv sets none
_HUMAN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_SCALE = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


@dataclass(frozen=True, slots=True)
class KnobSetting:
    """The server's memory knob as its argv sets it (or vLLM's default, `explicit` False)."""

    knob: MemoryKnob
    flag: str
    value: float
    explicit: bool = True

    def show(self, value: float | None = None) -> str:
        v = self.value if value is None else value
        return (
            f"{self.flag} {int(v)}"
            if self.knob == "kv_cache_memory_bytes"
            else f"{self.flag} {v:g}"
        )


@dataclass(frozen=True, slots=True)
class KnobStep:
    """The knob moved: the new argv and what changed, for the audit and the promotion."""

    setting: KnobSetting
    new_value: float
    argv: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class NoStep:
    """No step is taken: why (the pre-flight refused, no knob, a direction never stepped)."""

    reason: str


def parse_bytes(text: str) -> int | None:
    """vLLM's byte counts: `4294967296`, `4G` (10^9), `4Gi` (2^30); None when malformed."""
    match = _HUMAN.match(text)
    if match is None:
        return None
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    scale = (
        1
        if not unit
        else (1 << (10 * "kmgt".index(unit[0]) + 10) if unit.endswith("i") else _SCALE[unit])
    )
    return int(number * scale)


def memory_knob(argv: Sequence[str]) -> KnobSetting | NoStep:
    """The knob the argv turns: an explicit KV budget first, else the utilisation."""
    kv = flag_value(argv, KV_FLAG)
    if kv is not None:
        parsed = parse_bytes(kv)
        if parsed is None:
            return NoStep(f"{KV_FLAG} {kv!r} is not a byte count")
        return KnobSetting("kv_cache_memory_bytes", KV_FLAG, float(parsed))
    util = flag_value(argv, UTIL_FLAG)
    if util is None:
        return KnobSetting("gpu_memory_utilization", UTIL_FLAG, DEFAULT_UTILIZATION, False)
    try:
        return KnobSetting("gpu_memory_utilization", UTIL_FLAG, float(util))
    except ValueError:
        return NoStep(f"{UTIL_FLAG} {util!r} is not a number")


def plan_step(
    argv: Sequence[str], verdict: OomVerdict, config: OomConfig, knob_range: KnobRange
) -> KnobStep | NoStep:
    """The step `verdict` calls for on `argv`'s memory knob, checked against `knob_range`."""
    setting = memory_knob(argv)
    if isinstance(setting, NoStep):
        return setting
    if setting.knob != knob_range.knob:
        return NoStep(
            f"the planner's range is for {knob_range.knob}, the server turns {setting.knob}"
        )
    if verdict.direction is OomDirection.TOO_BIG:
        target, how = _down(setting, verdict, config, knob_range)
    else:
        if not config.step_up:
            return NoStep("too small: stepping up is off (remediation.oom.step_up); reported only")
        if setting.knob != "kv_cache_memory_bytes" or knob_range.low is None:
            return NoStep("too small: the planner has no minimum for this knob; reported only")
        target = knob_range.low * (1 + config.headroom_ratio)
        how = "up to the planner's minimum for one request plus the headroom"
        if target <= setting.value:
            return NoStep(f"too small, yet {setting.show()} is at the planner's minimum already")
    target = _round(setting, target, up=verdict.direction is OomDirection.TOO_SMALL)
    if target >= setting.value and verdict.direction is OomDirection.TOO_BIG:
        return NoStep(f"no smaller value fits: {setting.show()} is at the range's ceiling already")
    verdict_fit = check_knob(target, knob_range)
    if not verdict_fit.fits:
        return NoStep(f"pre-flight refused {setting.show(target)}: {verdict_fit.reason}")
    value: int | float = int(target) if setting.knob == "kv_cache_memory_bytes" else target
    new_argv = set_flag(argv, setting.flag, value)
    was = setting.show().split(" ", 1)[1]
    reason = f"{verdict.message}: {setting.show(target)} (was {was}), {how}"
    return KnobStep(setting, target, new_argv, reason)


def _down(
    setting: KnobSetting, verdict: OomVerdict, config: OomConfig, knob_range: KnobRange
) -> tuple[float, str]:
    if setting.knob == "kv_cache_memory_bytes" and verdict.available_bytes is not None:
        target = verdict.available_bytes * (1 - config.headroom_ratio)
        how = f"what the log says was available ({verdict.available_bytes} bytes) less the headroom"
    elif setting.knob == "kv_cache_memory_bytes" and config.step_bytes is not None:
        target, how = setting.value - config.step_bytes, f"down by {config.step_bytes} bytes"
    else:
        target = setting.value * (1 - config.step_ratio)
        how = f"down by {config.step_ratio:.0%}"
    if knob_range.high is not None and target > knob_range.high:
        target, how = knob_range.high, f"{how}, held to {knob_range.high_reason}"
    return target, how


def _round(setting: KnobSetting, value: float, *, up: bool) -> float:
    """Bytes to a whole MiB (readable flags), the utilisation to three places; down for a
    step down, up for a step up (so the planner's minimum is not rounded away)."""
    if setting.knob == "kv_cache_memory_bytes":
        if value < MIB:
            return float(math.ceil(value) if up else int(value))
        mibs = math.ceil(value / MIB) if up else int(value // MIB)
        return float(mibs * MIB)
    return math.ceil(value * 1000) / 1000 if up else math.floor(value * 1000) / 1000
