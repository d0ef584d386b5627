"""The edge checks one value at a time: what passes, and what becomes None with which reason."""

from __future__ import annotations

import math

import pytest

from kvpilot.collectors.checks import Refused, SampleChecks, same_reading
from kvpilot.collectors.histogram import Histogram

INF, NAN = math.inf, math.nan


def run(check: str, value: float | None, **kwargs: int) -> tuple[object, tuple[Refused, ...]]:
    checks = SampleChecks()
    got = getattr(checks, check)("f", value, **kwargs)
    return got, checks.done()


@pytest.mark.parametrize(
    ("check", "value", "expected"),
    [
        ("ratio", 0.0, 0.0),
        ("ratio", 1.0, 1.0),
        ("ratio", None, None),
        ("counter", 0.0, 0.0),
        ("counter", 1e18, 1e18),
        ("count", 3.0, 3),
        ("finite", -2.5, -2.5),
    ],
)
def test_sound_values_pass(check: str, value: float | None, expected: object) -> None:
    got, refused = run(check, value)
    assert got == expected and refused == ()


@pytest.mark.parametrize(
    ("check", "value", "reason"),
    [
        ("ratio", INF, "non_finite"),
        ("ratio", NAN, "non_finite"),
        ("ratio", 1.5, "out_of_range"),
        ("ratio", -0.5, "out_of_range"),
        ("counter", -17.5, "negative"),
        ("counter", -INF, "non_finite"),
        ("count", -3.0, "negative"),
        ("count", 2.5, "not_integer"),
        ("count", INF, "non_finite"),
        ("finite", NAN, "non_finite"),
    ],
)
def test_impossible_values_become_none_with_a_reason(check: str, value: float, reason: str) -> None:
    got, refused = run(check, value)
    assert got is None
    (item,) = refused
    assert (item.field, item.reason) == ("f", reason) and item.detail


def test_a_count_below_its_least_is_out_of_range() -> None:
    got, (item,) = run("count", 0.0, least=1)
    assert got is None and item.reason == "out_of_range"


def hist(
    buckets: list[tuple[float, float]], total: float = 1.0, count: float | None = None
) -> Histogram:
    return Histogram(tuple(buckets), total, buckets[-1][1] if count is None else count)


@pytest.mark.parametrize(
    ("h", "reason"),
    [
        (hist([(1.0, 2.0), (INF, 5.0)]), None),
        (hist([(1.0, 6.0), (INF, 5.0)]), "contradictory"),  # cumulative counts go down
        (hist([(1.0, 2.0), (INF, 5.0)], count=4.0), "contradictory"),
        (hist([(1.0, -2.0), (INF, 5.0)]), "negative"),
        (hist([(1.0, NAN), (INF, 5.0)]), "non_finite"),
        (hist([(1.0, 2.0), (INF, 5.0)], total=INF), "non_finite"),
        (hist([(NAN, 2.0), (INF, 5.0)]), "non_finite"),
    ],
)
def test_histograms(h: Histogram, reason: str | None) -> None:
    checks = SampleChecks()
    got = checks.histogram("ttft", h)
    if reason is None:
        assert got == h and checks.done() == ()
    else:
        assert got is None and [r.reason for r in checks.done()] == [reason]


def test_readings_agree_when_equal_or_both_nan() -> None:
    assert same_reading(1.0, 1.0) and same_reading(NAN, NAN)
    assert not same_reading(1.0, 2.0) and not same_reading(NAN, 1.0)
