"""The judge over repeated windows: the window, not the request, as the unit of evidence.

Requests in one window share its conditions (the batches they ran in, what else the core
did), so their latencies are not independent samples: pooled, the rank tests grow
overconfident (benchmarks/judge_calibration.py: at the margin a pooled non-inferiority
test passed 13-22 % of 10 % regressions, where it should pass at most 5 %). Given at least
`MIN_WINDOWS` windows a side, each latency and goodput is summarised per window (its median)
and tested across windows: paired windows, run at the same time on both sides (a parallel
canary), by Wilcoxon's signed-rank test of the pairs' differences, where each pair's shared
conditions cancel; windows one side after the other (a sequential canary) by Mann-Whitney U
of the two sides' summaries. Errors and preemptions stay counts over all windows. Fewer
windows are judged as one (`judge`), on the requests themselves.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpilot.tuner.judge.evidence import Counts, Samples
from kvpilot.tuner.judge.judgement import JudgeConfig, Judgement, judge, judge_tests
from kvpilot.tuner.judge.metric import MetricTest
from kvpilot.tuner.judge.vocabulary import Kind

MIN_WINDOWS = 5  # a one-sided signed-rank test of 5 pairs reaches p = 1/32 at best


@dataclass(frozen=True, slots=True)
class Window:
    """One window's samples on each side."""

    canary: Mapping[str, Samples]
    baseline: Mapping[str, Samples]


def judge_windows(
    windows: Sequence[Window],
    config: JudgeConfig | None = None,
    slo_limits: Mapping[str, float] | None = None,
    *,
    paired: bool = True,
) -> Judgement:
    """Compare the canary with the baseline over `windows` (see the module docstring)."""
    config = config or JudgeConfig()
    canary = pooled([w.canary for w in windows])
    baseline = pooled([w.baseline for w in windows])
    if len(windows) < MIN_WINDOWS:
        return judge(canary, baseline, config, slo_limits)
    limits = slo_limits or {}
    tests = []
    for spec in config.metrics:
        limit = limits.get(spec.name)
        if spec.kind is not Kind.SHIFT:
            c, b = canary.get(spec.name, ()), baseline.get(spec.name, ())
            tests.append(MetricTest.run(spec, c, b, config.alpha, limit))
            continue
        sides = [(_summary(w.canary, spec.name), _summary(w.baseline, spec.name)) for w in windows]
        if paired:  # a pair without data on one side is left out whole
            both = [(c, b) for c, b in sides if c is not None and b is not None]
            cs, bs = [c for c, _ in both], [b for _, b in both]
            tests.append(MetricTest.paired(spec, cs, bs, config.alpha, limit))
        else:
            cs = [c for c, _ in sides if c is not None]
            bs = [b for _, b in sides if b is not None]
            tests.append(MetricTest.run(spec, cs, bs, config.alpha, limit))
    return judge_tests(config, tests)


def pooled(sides: Sequence[Mapping[str, Samples]]) -> dict[str, Samples]:
    """Every window's samples together: samples joined, counts summed."""
    out: dict[str, Samples] = {}
    for side in sides:
        for name, value in side.items():
            have = out.get(name)
            if isinstance(value, Counts):
                prior = have if isinstance(have, Counts) else Counts(0.0, 0.0)
                out[name] = Counts(prior.events + value.events, prior.exposure + value.exposure)
            else:
                earlier = tuple(have) if have is not None and not isinstance(have, Counts) else ()
                out[name] = (*earlier, *value)
    return out


def _summary(side: Mapping[str, Samples], name: str) -> float | None:
    values = side.get(name, ())
    if isinstance(values, Counts) or not values:
        return None
    return statistics.median(values)
