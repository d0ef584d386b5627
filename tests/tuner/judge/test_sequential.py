"""The sequential judge on synthetic windows whose answer is known: it sees the tail, counts
errors and preemptions per window, never passes on a NaN, stops a clearly bad canary early
and says how many more windows an undecided one needs."""

from __future__ import annotations

import math

import pytest

from kvpilot.tuner.judge.evidence import dispersion
from kvpilot.tuner.judge.judgement import Classification
from kvpilot.tuner.judge.sequential import (
    DEFAULT_LOOKS,
    Look,
    LookDecision,
    LookPlan,
    Spending,
    judge_look,
    looks_for,
)
from kvpilot.tuner.judge.windows import Window, judge_windows
from tests.tuner.judge.synthetic import windows

PLAN = LookPlan()


def sequential(all_windows: list[Window], plan: LookPlan = PLAN, *, paired: bool = True) -> Look:
    """Look at each of the plan's looks in turn, as the rollout does, until one decides."""
    for at in plan.looks:
        look = judge_look(all_windows[:at], plan, paired=paired)
        if look.decision is not LookDecision.CONTINUE:
            return look
    raise AssertionError("the last look always decides")


def test_alpha_is_spent_over_the_looks_and_sums_to_alpha() -> None:
    for spending in Spending:
        shares = LookPlan(spending=spending).alphas(0.05)
        assert len(shares) == len(DEFAULT_LOOKS) and math.isclose(sum(shares), 0.05)
    pocock, obf = LookPlan().alphas(0.05), LookPlan(spending=Spending.OBRIEN_FLEMING).alphas(0.05)
    assert pocock[0] > 0.005 > obf[0]  # Pocock lets the first look decide; O'Brien-Fleming barely
    assert looks_for(64) == (8, 16, 32, 64) and looks_for(20) == (8, 16, 20)
    assert looks_for(5) == (5,)


@pytest.mark.parametrize("paired", [True, False], ids=["paired", "one-after-the-other"])
def test_an_equal_canary_passes_by_32_windows(paired: bool) -> None:
    looks = [sequential(windows(seed, 64), paired=paired) for seed in range(4)]
    assert all(look.decision is LookDecision.PASS for look in looks), [lk.summary() for lk in looks]
    if paired:
        assert all(look.windows <= 32 for look in looks)


def test_a_tenth_of_requests_at_ten_times_the_ttft_is_counted_against() -> None:
    # The p95 of each window sees the slow tenth; a window's median would not (it passed
    # such a canary before).
    for seed in range(4):
        look = sequential(windows(seed, 64, slow_share=0.1))
        assert look.decision is LookDecision.FAIL and look.windows <= 32, look.summary()
        ttft = next(m for m in look.judgement.metrics if m.name == "ttft_s")
        assert ttft.counts_against


def test_a_fifth_less_goodput_stops_early_as_a_fail() -> None:
    stops = [sequential(windows(seed, 64, goodput_scale=0.8)) for seed in range(4)]
    assert all(look.decision is LookDecision.FAIL for look in stops)
    assert sorted(look.windows for look in stops)[1] <= 16  # the median look


def test_one_percent_errors_against_none_never_passes() -> None:
    # One failed request in each window of 100: at every look, never a pass.
    bad = windows(3, 64, failed=1, requests=100)
    for at in DEFAULT_LOOKS:
        look = judge_look(bad[:at], PLAN)
        assert look.judgement.classification is not Classification.PASS, look.summary()
    assert sequential(bad).decision is LookDecision.FAIL


def test_a_nan_ttft_or_an_infinite_goodput_is_no_data_never_a_pass() -> None:
    good = windows(1, 32)
    for name, bad in (("ttft_s", math.nan), ("goodput_tokens_per_s", math.inf)):
        broken = list(good)
        first = broken[0]
        values = tuple(first.canary[name])  # type: ignore[arg-type]
        broken[0] = Window({**first.canary, name: (bad, *values[1:])}, first.baseline)
        for cut in (32, 3):  # over windows, and request by request (fewer than five)
            judgement = judge_windows(broken[:cut])
            assert judgement.classification is Classification.INCONCLUSIVE, judgement.reason
            verdict = next(m for m in judgement.metrics if m.name == name)
            assert verdict.reason.startswith("non-finite samples")
    assert judge_windows(good).promote  # the same windows without it pass


def test_an_undecided_canary_says_about_how_many_more_windows_it_needs() -> None:
    # 8 windows of 32 requests without an error: half a point needs about 550 requests a side.
    look = sequential(windows(2, 8, requests=32), LookPlan(looks=(8,)))
    assert look.decision is LookDecision.INCONCLUSIVE
    assert look.more_windows is not None and look.more_windows > 8
    assert look.judgement.classification is Classification.INCONCLUSIVE
    assert look.judgement.reason.startswith(f"about {look.more_windows} more windows needed")


def test_screening_windows_may_reject_and_never_promote() -> None:
    plan = LookPlan(looks=(16, 32))
    equal = judge_look(windows(0, 12), plan)  # before the first look: screening
    assert equal.decision is LookDecision.CONTINUE and not equal.judgement.promote
    bad = judge_look(windows(0, 12, goodput_scale=0.5), plan)
    assert bad.decision is LookDecision.FAIL


def test_clustered_errors_count_for_less_than_scattered_ones() -> None:
    scattered = dispersion([1.0] * 8, [64.0] * 8, binomial=True)
    clustered = dispersion([8.0] + [0.0] * 7, [64.0] * 8, binomial=True)
    assert scattered == 1.0 and clustered > 5
