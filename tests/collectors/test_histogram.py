"""Histogram arithmetic: reset-aware deltas and histogram_quantile() semantics."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest

from kvpilot.collectors.histogram import Histogram, add, delta, quantile

INF = math.inf


def hist(*buckets: tuple[float, float], total: float = 0.0) -> Histogram:
    return Histogram(buckets=tuple(buckets), sum=total, count=buckets[-1][1])


H = hist((0.1, 10), (0.5, 30), (1.0, 40), (INF, 40), total=17.0)


def test_quantile_interpolates_inside_the_bucket() -> None:
    # rank 20 of 40 falls in (0.1, 0.5], 10 of its 20 observations in: 0.1 + 0.4 * 10/20.
    assert quantile(0.5, H) == pytest.approx(0.3)
    # rank 36 falls in (0.5, 1.0], 6 of its 10: 0.5 + 0.5 * 6/10.
    assert quantile(0.9, H) == pytest.approx(0.8)


def test_lowest_bucket_starts_at_zero() -> None:
    # rank 5 of 40 is in the first bucket: 0 + 0.1 * 5/10.
    assert quantile(0.125, H) == pytest.approx(0.05)


def test_quantile_in_the_inf_bucket_gives_the_highest_finite_bound() -> None:
    h = hist((1.0, 5), (2.0, 5), (INF, 10))
    assert quantile(0.9, h) == 2.0
    assert quantile(1.0, h) == 2.0


def test_lowest_bound_not_positive_is_returned_as_is() -> None:
    h = hist((-1.0, 4), (0.0, 6), (INF, 8))
    assert quantile(0.25, h) == -1.0


def test_missing_cases_are_none_and_out_of_range_q_is_infinite() -> None:
    assert quantile(0.5, hist((1.0, 0), (INF, 0))) is None  # no observations
    assert quantile(0.5, Histogram(buckets=((1.0, 3),), sum=1, count=3)) is None  # no +Inf
    assert quantile(0.5, hist((INF, 3))) is None  # fewer than two buckets
    assert quantile(math.nan, H) is None
    assert quantile(-0.1, H) == -INF
    assert quantile(1.1, H) == INF


def test_non_monotonic_counts_are_forced_monotonic() -> None:
    # Prometheus lifts the 5 to 10 before searching: rank 12 of 20 is in (1.5, 2], whose
    # 10 observations start at 10: 1.5 + 0.5 * 2/10.
    h = hist((1.0, 10), (1.5, 5), (2.0, 20), (INF, 20))
    assert quantile(0.6, h) == pytest.approx(1.6)


def test_delta_subtracts_counts_sum_and_count() -> None:
    older = hist((0.1, 2), (1.0, 5), (INF, 6), total=3.0)
    newer = hist((0.1, 5), (1.0, 9), (INF, 10), total=5.5)
    d = delta(newer, older)
    assert d.buckets == ((0.1, 3), (1.0, 4), (INF, 4))
    assert d.count == 4 and d.sum == pytest.approx(2.5)


def test_delta_takes_the_newer_after_a_reset() -> None:
    older = hist((0.1, 5), (1.0, 9), (INF, 10), total=5.0)
    restarted = hist((0.1, 1), (1.0, 2), (INF, 2), total=0.7)
    assert delta(restarted, older) is restarted
    # One bucket going down is enough, even when the total grew.
    odd = hist((0.1, 4), (1.0, 20), (INF, 20), total=9.0)
    assert delta(odd, older) is odd
    # Another bucket layout (a restart with other buckets) is a reset too.
    other = hist((0.2, 6), (1.0, 9), (INF, 11), total=6.0)
    assert delta(other, older) is other


def test_add_sums_same_layouts_only() -> None:
    a = hist((0.1, 1), (INF, 2), total=1.0)
    b = hist((0.1, 3), (INF, 3), total=0.2)
    assert add(a, b) == Histogram(buckets=((0.1, 4), (INF, 5)), sum=1.2, count=5)
    assert add(a, hist((0.2, 1), (INF, 1))) is None


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_quantiles_match_prometheus_itself(tmp_path: Path) -> None:
    """promtool evaluates histogram_quantile() on the same buckets; it must agree exactly."""
    cases = {
        "h1": H,
        "h2": hist((1.0, 5), (2.0, 5), (INF, 10)),
        "h3": hist((0.005, 4), (0.01, 19), (0.02, 24), (0.04, 32), (0.25, 75), (INF, 121)),
        "h4": hist((1.0, 10), (1.5, 5), (2.0, 20), (INF, 20)),
    }
    qs = (0.01, 0.25, 0.5, 0.9, 0.95, 0.99, 1.0)
    series, tests = [], []
    for name, h in cases.items():
        for le, count in h.buckets:
            le_text = "+Inf" if le == INF else repr(le)
            series.append(f"      - series: '{name}_bucket{{le=\"{le_text}\"}}'\n")
            series.append(f"        values: '{count:g}'\n")
        for q in qs:
            expected = quantile(q, h)
            assert expected is not None
            tests.append(
                f"      - expr: histogram_quantile({q}, {name}_bucket)\n"
                f"        eval_time: 0\n"
                f"        exp_samples:\n"
                f"          - labels: '{{}}'\n"
                f"            value: {expected!r}\n"
            )
    (tmp_path / "empty.yml").write_text("groups: []\n")
    (tmp_path / "test.yml").write_text(
        "rule_files: [empty.yml]\n"
        "evaluation_interval: 1m\n"
        "tests:\n"
        "  - interval: 1m\n"
        "    input_series:\n" + "".join(series) + "    promql_expr_test:\n" + "".join(tests)
    )
    result = subprocess.run(
        ["promtool", "test", "rules", "test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
