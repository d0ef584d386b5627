"""The judge over repeated windows: the window, not the request, as the unit of evidence.

Requests in one window share its conditions (the batches they ran in, what else the core
did), so their latencies are not independent samples: pooled, the rank tests grow
overconfident (benchmarks/judge_calibration.py: at the margin a pooled non-inferiority
test passed 13-22 % of 10 % regressions, where it should pass at most 5 %). Given at least
`MIN_WINDOWS` windows a side, each latency and goodput is summarised per window (latencies
by the window's p95, `MetricSpec.window_quantile`: preemption stalls hit the tail) and
tested across windows on log ratios, the margin a ratio: paired windows, run at the same
time on both sides (a parallel canary), by Wilcoxon's signed-rank test of the pairs' log
ratios, where each pair's shared conditions cancel; windows one side after the other (a
sequential canary) by Mann-Whitney U of the two sides' logs. Errors and preemptions per
finished request are counts pooled over the windows, deflated by how much more they vary
between windows than independent requests would (they cluster). A NaN or an infinity is no
data, never a pass. Fewer windows are judged as one (`judge`), on the requests themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kvpilot.tuner.judge import evidence
from kvpilot.tuner.judge.evidence import Counts, Samples
from kvpilot.tuner.judge.judgement import JudgeConfig, Judgement, judge, judge_tests
from kvpilot.tuner.judge.metric import NON_FINITE, MetricTest, non_finite
from kvpilot.tuner.judge.vocabulary import MetricKind, MetricSpec

MIN_WINDOWS = 5  # a one-sided signed-rank test of 5 pairs reaches p = 1/32 at best

# Derived where a window does not carry it: the window's preemptions (counted over its
# seconds) over its finished requests (its requests that did not fail).
PREEMPTIONS_PER_REQUEST = "preemptions_per_request"


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
    alpha: float | None = None,
) -> Judgement:
    """Compare the canary with the baseline over `windows` (see the module docstring);
    `alpha` overrides the config's (a sequential look's share of it)."""
    config = config or JudgeConfig()
    if alpha is not None:
        config = replace(config, alpha=alpha)
    windows = [Window(per_request(w.canary), per_request(w.baseline)) for w in windows]
    if len(windows) < MIN_WINDOWS:
        canary = pooled([w.canary for w in windows])
        baseline = pooled([w.baseline for w in windows])
        return judge(canary, baseline, config, slo_limits)
    tests = [_windowed(spec, windows, config.alpha, paired) for spec in config.metrics]
    return judge_tests(config, tests)


def _windowed(
    spec: MetricSpec, windows: Sequence[Window], alpha: float, paired: bool
) -> MetricTest:
    if spec.kind is not MetricKind.SHIFT:
        return _counted(spec, windows, alpha)
    values = [v for w in windows for side in (w.canary, w.baseline) for v in _samples(side, spec)]
    bad = non_finite(values)
    if bad:
        return MetricTest.unusable(spec, alpha, f"{NON_FINITE} ({bad}): no data")
    sides = [(_summary(w.canary, spec), _summary(w.baseline, spec)) for w in windows]
    if paired:  # a pair without data on one side is left out whole
        both = [(c, b) for c, b in sides if c is not None and b is not None]
        cs, bs = [c for c, _ in both], [b for _, b in both]
    else:
        cs = [c for c, _ in sides if c is not None]
        bs = [b for _, b in sides if b is not None]
    return MetricTest.log_ratio(spec, cs, bs, alpha, paired=paired)


def _counted(spec: MetricSpec, windows: Sequence[Window], alpha: float) -> MetricTest:
    """Counts pooled over the windows, each side deflated by its over-dispersion."""
    sides: list[Counts | None] = []
    for pick in ("canary", "baseline"):
        counts = []
        for w in windows:
            value = getattr(w, pick).get(spec.name, ())
            if not isinstance(value, Counts):
                if non_finite(value):
                    return MetricTest.unusable(spec, alpha, f"{NON_FINITE}: no data")
                value = Counts(float(sum(value)), float(len(value))) if value else None
            if value is not None:
                counts.append(value)
        if not counts:
            sides.append(None)
            continue
        phi = evidence.dispersion(
            [c.events for c in counts],
            [c.exposure for c in counts],
            binomial=spec.kind is MetricKind.PROPORTION,
        )
        total = Counts(sum(c.events for c in counts), sum(c.exposure for c in counts))
        sides.append(evidence.deflated(total, phi))
    canary, baseline = sides
    return MetricTest.run(spec, canary if canary else (), baseline if baseline else (), alpha, None)


def per_request(side: Mapping[str, Samples]) -> Mapping[str, Samples]:
    """The side with its preemptions per finished request, where it gives them per second
    and says which requests failed (`errors_ratio`, one 0/1 a request)."""
    if PREEMPTIONS_PER_REQUEST in side:
        return side
    per_s, errors = side.get("preemptions_per_s"), side.get("errors_ratio")
    if not isinstance(per_s, Counts) or errors is None or isinstance(errors, Counts):
        return side
    finished = sum(1 for e in errors if e == 0)
    return {**side, PREEMPTIONS_PER_REQUEST: Counts(per_s.events, float(finished))}


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


def _samples(side: Mapping[str, Samples], spec: MetricSpec) -> Sequence[float]:
    values = side.get(spec.name, ())
    return () if isinstance(values, Counts) else values


def _summary(side: Mapping[str, Samples], spec: MetricSpec) -> float | None:
    """The window's `window_quantile` of the metric's samples (linear interpolation)."""
    values = sorted(_samples(side, spec))
    if not values:
        return None
    position = spec.window_quantile * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)
