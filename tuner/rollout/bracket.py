"""The stable instance's window as a sequential canary's window is judged against: the
stable's window k before the candidate and its window k after it, made one.

One instance measured one side after the other reads anything that drifts between the
phases (the hour's traffic, the device's temperature, a neighbour) as the candidate's
effect. Bracketed by the stable's windows on both sides, window k of the candidate sits
midway between them in time, so a drift linear in time cancels: each latency's quantile in
the bracketing window is the geometric mean of the two windows' same quantile (a drift
linear on the log scale cancels exactly, the judge compares log ratios), counts are summed
(their rate is the two windows' together), and the objective's measurement holds both
windows' requests over both windows' seconds.

Before the stable's windows after it exist, the candidate can only be held against those
before it: `drift_widened` gives the margins under which that comparison may still stop a
clearly bad candidate without mistaking a phase's drift for harm.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from kvpilot.collectors.vllm_metrics import EngineSample, VllmScrape
from kvpilot.tuner.judge.evidence import Counts, Samples
from kvpilot.tuner.judge.judgement import JudgeConfig
from kvpilot.tuner.judge.vocabulary import Direction, MetricKind, MetricSpec
from kvpilot.tuner.load.generator import LoadReport
from kvpilot.tuner.problem.objective import Measurement
from kvpilot.tuner.rollout.ports import Observation


def bracketing(
    before: Observation, after: Observation, metrics: Sequence[MetricSpec]
) -> Observation:
    """The stable's windows `before` and `after` the candidate's as one (see the module
    docstring); `metrics`: the judge's, whose SHIFT samples are quantile-averaged."""
    shifts = {m.name for m in metrics if m.kind is MetricKind.SHIFT}
    samples = {
        name: _joined(before.samples.get(name, ()), after.samples.get(name, ()), name in shifts)
        for name in (*before.samples, *(n for n in after.samples if n not in before.samples))
    }
    return Observation(
        after.url, _measured_together(before.measurement, after.measurement), samples
    )


def _joined(a: Samples, b: Samples, shift: bool) -> Samples:
    if isinstance(a, Counts) and isinstance(b, Counts):
        return Counts(a.events + b.events, a.exposure + b.exposure)
    if isinstance(a, Counts) or isinstance(b, Counts):  # counted on one side only
        return a if isinstance(a, Counts) else b
    if not a or not b:
        return tuple(a or b)
    if not shift:  # per-request 0/1 (errors): both windows' requests
        return (*a, *b)
    return log_quantile_mean(a, b)


def log_quantile_mean(a: Sequence[float], b: Sequence[float]) -> tuple[float, ...]:
    """Samples whose every quantile is the geometric mean of `a`'s and `b`'s same quantile
    (on a grid as fine as the larger sample; linear interpolation between order
    statistics, as the judge's window summary takes them). A negative or non-finite sample
    gives NaN there: no data, never a pass."""
    n = max(len(a), len(b))
    qa, qb = _on_grid(sorted(a), n), _on_grid(sorted(b), n)
    pairs = zip(qa, qb, strict=True)
    return tuple(math.sqrt(x * y) if x >= 0 and y >= 0 else math.nan for x, y in pairs)


def _on_grid(ordered: Sequence[float], n: int) -> list[float]:
    if n == 1 or len(ordered) == 1:
        return [ordered[0]] * n if len(ordered) == 1 else [ordered[0]]
    out = []
    for i in range(n):
        position = i * (len(ordered) - 1) / (n - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        out.append(ordered[low] + (ordered[high] - ordered[low]) * (position - low))
    return out


def _measured_together(before: Measurement, after: Measurement) -> Measurement:
    """Both windows' requests over both windows' seconds (a request's times are only read
    relative to its own start), and their preemptions summed; without a report on both
    sides (histograms only) the later window's measurement."""
    if before.report is None or after.report is None:
        return after
    report = LoadReport(
        0.0,
        before.report.duration_s + after.report.duration_s,
        (*before.report.results, *after.report.results),
    )
    return Measurement(
        report=report,
        scrapes=_continued(before.scrapes, after.scrapes),
        memory_bytes=after.memory_bytes if after.memory_bytes is not None else before.memory_bytes,
    )


def _continued(first: Sequence[VllmScrape], second: Sequence[VllmScrape]) -> tuple[VllmScrape, ...]:
    """`second`'s scrapes restamped to follow `first`'s, each engine's preemption counter
    carried on from where `first` left it (the server restarted in between: its counters
    began again), so the preemptions over them are both windows' summed. Empty when either
    window has fewer than two scrapes: the preemptions are then unknown, not half-counted."""
    if len(first) < 2 or len(second) < 2:
        return ()
    shift_s = first[-1].taken_at_s - second[0].taken_at_s + 1.0
    left = {e.key: e.preemptions_total for e in first[-1].engines}
    began = {e.key: e.preemptions_total for e in second[0].engines}

    def carried(engine: EngineSample) -> EngineSample:
        base, start, now = left.get(engine.key), began.get(engine.key), engine.preemptions_total
        value = None if base is None or start is None or now is None else base + now - start
        return dataclasses.replace(
            engine, taken_at_s=engine.taken_at_s + shift_s, preemptions_total=value
        )

    moved = (
        dataclasses.replace(
            s, taken_at_s=s.taken_at_s + shift_s, engines=tuple(carried(e) for e in s.engines)
        )
        for s in second
    )
    return (*first, *moved)


def drift_widened(config: JudgeConfig, drift_ratio: float) -> JudgeConfig:
    """`config` with every latency's and goodput's margin widened by a factor of
    1 + `drift_ratio` (x1.1 becomes x1.375 at 0.25; a tenth less goodput, 28 % less): what a
    one-sided comparison must show before it blames the candidate and not the drift.
    Counts (errors, preemptions) keep their margins: a drift does not make requests fail."""
    grown = 1 + drift_ratio

    def widened(spec: MetricSpec) -> MetricSpec:
        if spec.kind is not MetricKind.SHIFT:
            return spec
        if spec.direction is Direction.DECREASE:
            return dataclasses.replace(spec, tolerance_ratio=1 - (1 - spec.tolerance_ratio) / grown)
        return dataclasses.replace(spec, tolerance_ratio=(1 + spec.tolerance_ratio) * grown - 1)

    return dataclasses.replace(config, metrics=tuple(widened(m) for m in config.metrics))
