"""A live analysis judged interval by interval, the two sides' intervals paired.

Both pods are scraped on the same ticks, so the stable's interval and the canary's interval
between the same two ticks shared their conditions: the arrivals, the time of day, a burst
that slows both. Each such pair is one window of the window judge (`judge_windows`, paired:
Wilcoxon's signed-rank test of the pairs' log ratios, where what they shared cancels), its
sides' samples that interval's (one mean a latency: a one-sample window's summary is that
sample). An interval that has no pair (a failed scrape made one side's span two ticks) is
left out whole, and an interval where a side finished no request is left out of that
metric's pairs. Errors and preemptions stay counts, pooled over the intervals and deflated
by how much more they vary between intervals than independent requests would.

Fewer than `MIN_WINDOWS` pairs is too few to judge paired: inconclusive, said so, never the
request-level fallback the window judge takes for fewer windows.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.tuner.judge.judgement import Classification, Judgement
from kvpilot.tuner.judge.sequential import Look, LookDecision, judge_look
from kvpilot.tuner.judge.windows import MIN_WINDOWS, Window
from kvpilot.tuner.rollout.ports import Observation
from kvpilot.tuner.rollout.settings import RolloutSettings


def judges_intervals(observations: Sequence[Observation]) -> bool:
    """Whether the observations are analyses of intervals (live traffic), not windows."""
    return any(o.intervals is not None for o in observations)


def interval_windows(
    baselines: Sequence[Observation], canaries: Sequence[Observation]
) -> list[Window]:
    """One window per pair of intervals of the same ticks in the same analysis, in the
    baseline's order; an interval without its pair is left out."""
    windows: list[Window] = []
    for baseline, canary in zip(baselines, canaries, strict=False):
        by_ticks = {(i.start_tick, i.end_tick): i for i in canary.intervals or ()}
        for stable in baseline.intervals or ():
            paired = by_ticks.get((stable.start_tick, stable.end_tick))
            if paired is not None:
                windows.append(Window(paired.samples, stable.samples))
    return windows


def interval_look(
    baselines: Sequence[Observation], canaries: Sequence[Observation], settings: RolloutSettings
) -> Look:
    """The judge over the analyses' paired intervals (see the module docstring)."""
    windows = interval_windows(baselines, canaries)
    if len(windows) < MIN_WINDOWS:
        intervals = sum(len(b.intervals or ()) for b in baselines[: len(canaries)])
        reason = (
            f"insufficient evidence: {len(windows)} of the stable's {intervals} intervals have "
            f"the canary's interval of the same ticks, fewer than the {MIN_WINDOWS} a paired "
            "judgement needs (a longer canary.analysis_s, or a shorter analysis_interval_s)"
        )
        judgement = Judgement(Classification.INCONCLUSIVE, 0.0, (), reason)
        return Look(len(windows), settings.judge.alpha, judgement, LookDecision.INCONCLUSIVE)
    limits = settings.slo.judge_limits()
    return judge_look(windows, settings.look_plan, settings.judge, limits, paired=True)
