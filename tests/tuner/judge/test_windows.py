"""The judge over repeated windows: the window as the unit of evidence. Simulated with fixed
seeds: requests of one window share its conditions, as on a real server."""

from __future__ import annotations

import random

import pytest

from kvpilot.tuner.judge.evidence import Counts
from kvpilot.tuner.judge.judgement import (
    DEFAULT_METRICS,
    JudgeConfig,
    Verdict,
    judge,
    with_margin_ratios,
)
from kvpilot.tuner.judge.windows import MIN_WINDOWS, Window, judge_windows, pooled

TTFT = next(m for m in DEFAULT_METRICS if m.name == "ttft_s")
ONLY_TTFT = JudgeConfig(metrics=(TTFT,))


def _window(rng: random.Random, level: float, requests: int = 48) -> tuple[float, ...]:
    """A window's TTFTs: one draw of the window's conditions (a tenth either way) that every
    request in it shares, then each request's own noise."""
    shared = level * rng.lognormvariate(0.0, 0.1)
    return tuple(shared * rng.lognormvariate(0.0, 0.05) for _ in range(requests))


def _run(rng: random.Random, windows: int, canary_level: float) -> list[Window]:
    return [
        Window({"ttft_s": _window(rng, canary_level)}, {"ttft_s": _window(rng, 1.0)})
        for _ in range(windows)
    ]


def _ttft(judgement) -> object:
    return next(m for m in judgement.metrics if m.name == "ttft_s")


def test_shared_window_conditions_fool_the_pooled_tests_and_not_the_windowed() -> None:
    rng = random.Random(12)
    runs = [_run(rng, 8, 1.1) for _ in range(200)]  # 10 % worse; the margin is 10 %
    pooled_passed = windowed_passed = 0
    for run in runs:
        together = judge(
            pooled([w.canary for w in run]), pooled([w.baseline for w in run]), ONLY_TTFT
        )
        pooled_passed += _ttft(together).verdict is Verdict.PASS
        windowed_passed += _ttft(judge_windows(run, ONLY_TTFT)).verdict is Verdict.PASS
    # 8 x 48 requests pooled look like 384 independent samples, and a regression at the
    # margin passes as "not worse" far more often than alpha allows; by window, it does not.
    assert pooled_passed / len(runs) > 0.25
    assert windowed_passed / len(runs) <= 0.05


def test_an_equal_canary_can_pass_on_eight_windows() -> None:
    rng = random.Random(12)
    runs = [_run(rng, 8, 1.0) for _ in range(100)]
    passed = sum(_ttft(judge_windows(run, ONLY_TTFT)).verdict is Verdict.PASS for run in runs)
    assert passed / len(runs) > 0.3


def test_a_canary_better_in_every_window_passes_and_one_worse_counts_against() -> None:
    rng = random.Random(13)
    better = judge_windows(_run(rng, 8, 0.6), ONLY_TTFT)
    assert _ttft(better).verdict is Verdict.PASS, _ttft(better).reason
    worse = judge_windows(_run(rng, 8, 1.6), ONLY_TTFT)
    assert _ttft(worse).counts_against, _ttft(worse).reason


def test_fewer_windows_than_the_least_are_judged_as_one() -> None:
    rng = random.Random(14)
    run = _run(rng, MIN_WINDOWS - 1, 1.0)
    together = judge(pooled([w.canary for w in run]), pooled([w.baseline for w in run]))
    assert judge_windows(run) == together


def test_counts_are_summed_over_the_windows_and_samples_joined() -> None:
    sides = [
        {"errors_ratio": Counts(1, 40), "ttft_s": (0.1, 0.2)},
        {"errors_ratio": Counts(0, 50), "ttft_s": (0.3,)},
    ]
    assert pooled(sides) == {"errors_ratio": Counts(1, 90), "ttft_s": (0.1, 0.2, 0.3)}


def test_a_pair_missing_one_side_is_left_out_whole() -> None:
    rng = random.Random(15)
    run = _run(rng, MIN_WINDOWS + 1, 1.0)
    run[0] = Window({}, run[0].baseline)
    verdict = _ttft(judge_windows(run, ONLY_TTFT))
    assert (verdict.canary_count, verdict.baseline_count) == (MIN_WINDOWS, MIN_WINDOWS)


def test_a_wider_latency_margin_passes_a_rise_the_operator_accepts_and_no_more() -> None:
    rng = random.Random(15)
    run = _run(rng, 8, 1.4)  # a larger batch: every decode step 40 % longer
    assert _ttft(judge_windows(run, ONLY_TTFT)).verdict is not Verdict.PASS
    wide = JudgeConfig(metrics=with_margin_ratios(ONLY_TTFT.metrics, ttft_s=1.0))
    assert _ttft(judge_windows(run, wide)).verdict is Verdict.PASS
    assert _ttft(judge_windows(_run(rng, 8, 2.6), wide)).counts_against
    with pytest.raises(ValueError, match="no such metric: tft_s"):
        with_margin_ratios(DEFAULT_METRICS, tft_s=1.0)
    with pytest.raises(ValueError, match="below 1 for a loss"):
        with_margin_ratios(DEFAULT_METRICS, goodput_tokens_per_s=1.0)
