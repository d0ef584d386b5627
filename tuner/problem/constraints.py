"""Constraints on a candidate, checked before a trial is spent.

A constraint sees the candidate's knob values merged with the fixed flags (engine-argument
names, e.g. ``max_num_seqs``) and returns None when it holds, else the reason it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvpilot.tuner.planner import FeasibleBounds

Value = float | int | str | bool


@dataclass(frozen=True, slots=True)
class Constraint:
    """A rule over knob and fixed values; `check` returns None or the reason it is broken."""

    name: str
    check: Callable[[Mapping[str, Value]], str | None]


def planner_constraint(bounds: FeasibleBounds) -> Constraint:
    """The planner's bounds on the memory knobs: the budget holds one request, and starts."""

    def check(values: Mapping[str, Value]) -> str | None:
        util = values.get("gpu_memory_utilization")
        if isinstance(util, int | float):
            low, high = bounds.min_gpu_memory_utilization, bounds.max_gpu_memory_utilization
            if low is not None and util < low:
                return f"gpu_memory_utilization {util} < {low} (too little for one request)"
            if high is not None and util > high:
                return f"gpu_memory_utilization {util} > {high} (more than is free)"
        kv = values.get("kv_cache_memory_bytes")
        if isinstance(kv, int | float):
            if kv < bounds.min_kv_cache_memory_bytes:
                return (
                    f"kv_cache_memory_bytes {kv} < {bounds.min_kv_cache_memory_bytes} (one request)"
                )
            if (
                bounds.max_kv_cache_memory_bytes is not None
                and kv > bounds.max_kv_cache_memory_bytes
            ):
                return f"kv_cache_memory_bytes {kv} > {bounds.max_kv_cache_memory_bytes}"
        return None

    return Constraint("planner", check)


def batched_tokens_constraint() -> Constraint:
    """vLLM refuses max_num_batched_tokens < max_num_seqs."""

    def check(values: Mapping[str, Value]) -> str | None:
        seqs, tokens = values.get("max_num_seqs"), values.get("max_num_batched_tokens")
        if isinstance(seqs, int | float) and isinstance(tokens, int | float) and seqs > tokens:
            return f"max_num_seqs {seqs} > max_num_batched_tokens {tokens}"
        return None

    return Constraint("batched_tokens", check)


_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda a, b: a <= b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    ">": lambda a, b: a > b,
}


def parse_constraint(text: str) -> Constraint:
    """A user constraint such as "max_num_seqs * 64 <= max_num_batched_tokens".

    Each side is a number, a knob or fixed-flag name, or a product of the two; a side that
    names a value the candidate does not have leaves the constraint satisfied.
    """
    for op in _OPS:  # two-character operators are listed first
        if op in text:
            left_text, right_text = (part.strip() for part in text.split(op, 1))
            break
    else:
        raise ValueError(f"no comparison in constraint {text!r}")
    left, right = _term(left_text, text), _term(right_text, text)
    compare = _OPS[op]

    def check(values: Mapping[str, Value]) -> str | None:
        a, b = left(values), right(values)
        if a is None or b is None or compare(a, b):
            return None
        return f"{text} does not hold ({a:g} vs {b:g})"

    return Constraint(f"user[{text}]", check)


def _term(text: str, whole: str) -> Callable[[Mapping[str, Value]], float | None]:
    factors = [f.strip() for f in text.split("*")]
    if not all(factors):
        raise ValueError(f"bad term {text!r} in constraint {whole!r}")

    def value(values: Mapping[str, Value]) -> float | None:
        product = 1.0
        for factor in factors:
            try:
                product *= float(factor)
                continue
            except ValueError:
                pass
            item = values.get(factor.replace("-", "_").lstrip("_"))
            if isinstance(item, bool) or not isinstance(item, int | float):
                return None
            product *= float(item)
        return product

    return value
