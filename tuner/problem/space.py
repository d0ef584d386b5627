"""The search space: vLLM flags as knobs with ranges, types and scales, plus constraints.

Every knob maps its values onto the unit interval (log knobs through their logarithm), so the
suggesters work in the unit cube and never need to know about flags. Choices (block size,
KV dtype, a boolean flag) are ordinal on that interval: their order is the order given.
Constraints are checked before a trial is spent; a candidate that breaks one is never run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from kvpilot.tuner.planner import FeasibleBounds
from kvpilot.tuner.problem.constraints import (
    Constraint,
    Value,
    batched_tokens_constraint,
    parse_constraint,
    planner_constraint,
)

MEMORY_KNOBS = ("gpu_memory_utilization", "kv_cache_memory_bytes")
REAL_DIGITS = 4  # reals are rounded so the flag passed equals the value recorded


class KnobKind(StrEnum):
    """How a knob's values are drawn."""

    REAL = "real"
    INTEGER = "integer"
    CHOICE = "choice"
    FLAG = "flag"  # a boolean flag: --name / --no-name


@dataclass(frozen=True, slots=True)
class Knob:
    """One vLLM flag the tuner may turn; `levels` restricts a numeric knob to given values."""

    name: str  # the engine argument, e.g. "max_num_seqs"
    kind: KnobKind
    low: float | None = None
    high: float | None = None
    log_scale: bool = False
    choices: tuple[Value, ...] = ()
    levels: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind in (KnobKind.REAL, KnobKind.INTEGER):
            if self.low is None or self.high is None or not self.low <= self.high:
                raise ValueError(f"{self.name}: a numeric knob needs low <= high")
            if self.log_scale and self.low <= 0:
                raise ValueError(f"{self.name}: a log-scale knob needs a positive low")
            if any(not self.low <= v <= self.high for v in self.levels):
                raise ValueError(f"{self.name}: every level must lie in [low, high]")
        elif not self.choices:
            raise ValueError(f"{self.name}: a choice knob needs choices")

    @property
    def flag(self) -> str:
        """The command-line flag, e.g. --max-num-seqs."""
        return "--" + self.name.replace("_", "-")

    @property
    def numeric(self) -> bool:
        return self.kind in (KnobKind.REAL, KnobKind.INTEGER)

    def to_unit(self, value: Value) -> float:
        """The value's position in [0, 1]."""
        if not self.numeric:
            if len(self.choices) == 1:
                return 0.5
            return self.choices.index(value) / (len(self.choices) - 1)
        low, high = self._range()
        v = float(value)
        if high == low:
            return 0.5
        if self.log_scale:
            low, high, v = math.log(low), math.log(high), math.log(v)
        return min(1.0, max(0.0, (v - low) / (high - low)))

    def from_unit(self, u: float) -> Value:
        """The value at position u in [0, 1] (snapped to a level or choice, rounded)."""
        u = min(1.0, max(0.0, u))
        if not self.numeric:
            return self.choices[round(u * (len(self.choices) - 1))]
        if self.levels:
            return self._typed(min(self.levels, key=lambda v: abs(self.to_unit(v) - u)))
        low, high = self._range()
        if self.log_scale:
            raw = math.exp(math.log(low) + u * (math.log(high) - math.log(low)))
        else:
            raw = low + u * (high - low)
        return self._typed(min(high, max(low, raw)))

    def contains(self, value: Value) -> bool:
        """Whether the value is one this knob can take."""
        if not self.numeric:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.kind is KnobKind.INTEGER and int(value) != value:
            return False
        if self.levels:
            return float(value) in self.levels
        low, high = self._range()
        return low <= float(value) <= high

    def grid(self, points: int) -> tuple[Value, ...]:
        """Ascending values to walk: the levels or choices, else `points` evenly in scale."""
        if self.levels:
            return tuple(self._typed(v) for v in sorted(self.levels))
        if not self.numeric:
            return self.choices
        count = max(1, points)
        units = [0.5] if count == 1 else [i / (count - 1) for i in range(count)]
        return tuple(dict.fromkeys(self.from_unit(u) for u in units))

    def argv(self, value: Value) -> list[str]:
        """The flag and its value as they go on vLLM's command line."""
        if self.kind is KnobKind.FLAG:
            return [self.flag if value else "--no-" + self.flag[2:]]
        return [self.flag, str(value)]

    def _typed(self, raw: float) -> Value:
        if self.kind is KnobKind.INTEGER:
            return round(raw)
        return round(raw, REAL_DIGITS)

    def _range(self) -> tuple[float, float]:
        """Low and high of a numeric knob (construction checked that both are set)."""
        if self.low is None or self.high is None:
            raise ValueError(f"{self.name}: a {self.kind} knob has no range")
        return float(self.low), float(self.high)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One point of the space: knob name -> value, in the space's knob order."""

    values: tuple[tuple[str, Value], ...]

    def __getitem__(self, name: str) -> Value:
        for key, value in self.values:
            if key == name:
                return value
        raise KeyError(name)

    def get(self, name: str) -> Value | None:
        return dict(self.values).get(name)

    def as_dict(self) -> dict[str, Value]:
        return dict(self.values)

    def describe(self) -> str:
        """A short human form, e.g. "max_num_seqs=32 gpu_memory_utilization=0.85"."""
        return " ".join(f"{k}={v}" for k, v in self.values)


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """The knobs, the flags that stay fixed, and the constraints a candidate must meet."""

    knobs: tuple[Knob, ...]
    fixed: tuple[tuple[str, Value], ...] = ()
    constraints: tuple[Constraint, ...] = ()

    def __post_init__(self) -> None:
        names = [k.name for k in self.knobs]
        if not names or len(set(names)) != len(names):
            raise ValueError("a search space needs at least one knob and unique knob names")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.knobs)

    def knob(self, name: str) -> Knob:
        for knob in self.knobs:
            if knob.name == name:
                return knob
        raise KeyError(name)

    def candidate(self, values: Mapping[str, Value]) -> Candidate:
        """A candidate from explicit values; every knob must be given and valid."""
        missing = [n for n in self.names if n not in values]
        if missing:
            raise ValueError(f"missing knob values: {', '.join(missing)}")
        for knob in self.knobs:
            if not knob.contains(values[knob.name]):
                raise ValueError(f"{knob.name}={values[knob.name]!r} is outside the knob")
        return Candidate(tuple((n, values[n]) for n in self.names))

    def from_unit(self, point: Sequence[float]) -> Candidate:
        """The candidate at a point of the unit cube."""
        return Candidate(
            tuple((k.name, k.from_unit(u)) for k, u in zip(self.knobs, point, strict=True))
        )

    def to_unit(self, candidate: Candidate) -> tuple[float, ...]:
        return tuple(k.to_unit(candidate[k.name]) for k in self.knobs)

    def violation(self, candidate: Candidate) -> str | None:
        """The first broken constraint's reason, or None when the candidate may be tried."""
        merged = {**dict(self.fixed), **candidate.as_dict()}
        for constraint in self.constraints:
            reason = constraint.check(merged)
            if reason is not None:
                return f"{constraint.name}: {reason}"
        return None

    def argv(self, candidate: Candidate) -> list[str]:
        """The candidate's flags for vLLM's command line (the fixed flags are the caller's)."""
        out: list[str] = []
        for knob in self.knobs:
            out += knob.argv(candidate[knob.name])
        return out

    def grid(self, points_per_knob: int, order: Sequence[str] | None = None) -> list[Candidate]:
        """Every grid point, row-major: the first name in `order` is the outer loop."""
        names = list(order or self.names)
        if sorted(names) != sorted(self.names):
            raise ValueError("order must name every knob once")
        rows: list[dict[str, Value]] = [{}]
        for name in names:
            values = self.knob(name).grid(points_per_knob)
            rows = [{**row, name: v} for row in rows for v in values]
        return [Candidate(tuple((n, row[n]) for n in self.names)) for row in rows]

    def safe_region(self, margin_ratio: float = 0.15) -> SearchSpace:
        """The space with each memory knob's range pulled in by `margin_ratio` at both ends."""
        knobs = []
        for knob in self.knobs:
            if knob.name in MEMORY_KNOBS and knob.numeric and not knob.levels:
                low, high = knob.from_unit(margin_ratio), knob.from_unit(1 - margin_ratio)
                knob = replace(knob, low=float(low), high=float(high))
            knobs.append(knob)
        return replace(self, knobs=tuple(knobs))

    def latin_hypercube(self, n: int, rng: random.Random, attempts: int = 20) -> list[Candidate]:
        """Up to n distinct candidates that meet the constraints, stratified on every knob."""
        out: list[Candidate] = []
        for _ in range(attempts):
            columns = []
            for _knob in self.knobs:
                strata = [(i + rng.random()) / n for i in range(n)]
                rng.shuffle(strata)
                columns.append(strata)
            for point in zip(*columns, strict=True):
                cand = self.from_unit(point)
                if cand not in out and self.violation(cand) is None:
                    out.append(cand)
                if len(out) == n:
                    return out
        return out


# Knobs a user may add by name; ranges are overridable (`optional_knob(..., low=, high=)`).
_CATALOGUE: dict[str, Knob] = {
    "max_num_batched_tokens": Knob(
        "max_num_batched_tokens", KnobKind.INTEGER, 512, 16384, log_scale=True
    ),
    "block_size": Knob("block_size", KnobKind.CHOICE, choices=(16, 32, 64)),
    "kv_cache_dtype": Knob("kv_cache_dtype", KnobKind.CHOICE, choices=("auto", "fp8")),
    "enable_prefix_caching": Knob("enable_prefix_caching", KnobKind.FLAG, choices=(False, True)),
}


def optional_knob(
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    choices: Sequence[Value] = (),
    levels: Sequence[float] = (),
) -> Knob:
    """One of the optional knobs (or kv_cache_memory_bytes with a range), by engine-arg name."""
    name = name.lstrip("-").replace("-", "_")
    if name == "kv_cache_memory_bytes":
        if low is None or high is None:
            raise ValueError("kv_cache_memory_bytes needs low and high (or the planner's bounds)")
        base = Knob(name, KnobKind.INTEGER, low, high, log_scale=True)
    elif name in _CATALOGUE:
        base = _CATALOGUE[name]
    else:
        raise ValueError(f"unknown knob {name!r}; known: {', '.join(sorted(_CATALOGUE))}")
    return replace(
        base,
        low=base.low if low is None else low,
        high=base.high if high is None else high,
        choices=tuple(choices) if choices else base.choices,
        levels=tuple(levels) if levels else base.levels,
    )


def default_space(
    bounds: FeasibleBounds | None = None,
    *,
    memory_knob: str = "gpu_memory_utilization",
    max_num_seqs_range: tuple[int, int] = (1, 512),
    extra_knobs: Sequence[Knob] = (),
    fixed: Mapping[str, Value] | None = None,
    user_constraints: Sequence[str] = (),
) -> SearchSpace:
    """The memory knob (ranged by the planner's bounds) and max_num_seqs, plus extras.

    `memory_knob` is "gpu_memory_utilization" on a GPU, "kv_cache_memory_bytes" on the CPU
    rig (where the utilisation is a fraction of the host's RAM and never used).
    """
    if memory_knob == "gpu_memory_utilization":
        low = bounds.min_gpu_memory_utilization if bounds is not None else None
        high = bounds.max_gpu_memory_utilization if bounds is not None else None
        memory = Knob(memory_knob, KnobKind.REAL, low or 0.5, high or 0.95)
    elif memory_knob == "kv_cache_memory_bytes":
        if bounds is None or bounds.max_kv_cache_memory_bytes is None:
            raise ValueError("kv_cache_memory_bytes needs the planner's bounds with a maximum")
        memory = optional_knob(
            memory_knob, low=bounds.min_kv_cache_memory_bytes, high=bounds.max_kv_cache_memory_bytes
        )
    else:
        raise ValueError(f"memory_knob must be one of {MEMORY_KNOBS}")
    seqs = Knob("max_num_seqs", KnobKind.INTEGER, *max_num_seqs_range, log_scale=True)
    constraints = [batched_tokens_constraint(), *(parse_constraint(t) for t in user_constraints)]
    if bounds is not None:
        constraints.insert(0, planner_constraint(bounds))
    return SearchSpace(
        knobs=(memory, seqs, *extra_knobs),
        fixed=tuple(sorted((fixed or {}).items())),
        constraints=tuple(constraints),
    )
