"""The canary judge, as Kayenta does it: per-metric Mann-Whitney U with a tolerance band.

For each metric the canary's samples are compared with the baseline's. The verdict is PASS
when the two-sided Mann-Whitney U test finds no difference at `alpha`, or when the shift
(Hodges-Lehmann: the median of all canary-minus-baseline differences) lies inside the
tolerance band (`tolerance_ratio` of the baseline's median, at least `tolerance_abs`, and
at least `slo_tolerance_ratio` of the SLO's limit for the metric where the caller gives one);
otherwise HIGH or LOW by the shift's sign. The SLO term is there because a regression is
what the user would notice: a larger batch may double a 3 ms inter-token gap, and with a
100 ms limit that is not worth rolling back a candidate that ends heavy preemption.
A HIGH counts against the canary only for a metric whose direction says an increase is bad
(latencies, errors), a LOW only where a decrease is bad, either for "either". The score is
the weighted share of metrics that did not count against the canary; a failing critical
metric fails the whole. Only PASS promotes.

The judge counts only what users feel: latencies, preemptions, errors and goodput. KV usage
is the memory knob's own consequence (a smaller budget fills more of itself at equal
service), so it is compared and shown but never counted (`MetricSpec.counted`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Direction(StrEnum):
    """Which change of a metric is bad."""

    INCREASE = "increase"
    DECREASE = "decrease"
    EITHER = "either"


class Verdict(StrEnum):
    PASS = "pass"  # noqa: S105 (a verdict, not a password)
    HIGH = "high"
    LOW = "low"
    NODATA = "nodata"


class Classification(StrEnum):
    PASS = "pass"  # noqa: S105 (a verdict, not a password)
    MARGINAL = "marginal"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """How one metric is judged."""

    name: str
    direction: Direction
    tolerance_ratio: float = 0.1
    tolerance_abs: float = 0.0
    weight: float = 1.0
    critical: bool = False
    min_samples: int = 5
    slo_tolerance_ratio: float = 0.0  # of the SLO's limit for this metric, when one is given
    counted: bool = True  # False: compared and shown as information, never in the score


# What users feel, judged alike on replay and on live traffic: latencies, errors, goodput.
_LATENCIES: tuple[MetricSpec, ...] = (
    MetricSpec(
        "ttft_s",
        Direction.INCREASE,
        tolerance_ratio=0.1,
        tolerance_abs=0.005,
        slo_tolerance_ratio=0.1,
    ),
    MetricSpec(
        "inter_token_s",
        Direction.INCREASE,
        tolerance_ratio=0.1,
        tolerance_abs=0.001,
        slo_tolerance_ratio=0.1,
    ),
    MetricSpec("e2e_s", Direction.INCREASE, tolerance_ratio=0.1, tolerance_abs=0.01),
)
_GOODPUT = MetricSpec("goodput_tokens_per_s", Direction.DECREASE, tolerance_ratio=0.1)
_ERRORS = MetricSpec("errors_ratio", Direction.INCREASE, tolerance_abs=0.01, critical=True)
# Information only: a smaller KV budget fills more of itself; that is the saving, not a harm.
KV_USAGE_INFO = MetricSpec(
    "kv_usage_ratio", Direction.INCREASE, tolerance_ratio=0.25, tolerance_abs=0.05, counted=False
)

# Replay: both sides get the whole workload, so per-second rates compare.
DEFAULT_METRICS: tuple[MetricSpec, ...] = (
    *_LATENCIES,
    MetricSpec("preemptions_per_s", Direction.INCREASE, tolerance_ratio=0.2, tolerance_abs=0.05),
    _GOODPUT,
    _ERRORS,
    KV_USAGE_INFO,
)


# Live traffic splits it unevenly: per-request and per-share figures compare, totals do not
# (a canary on 10 % sees a tenth of the preemptions). Goodput is the generation rate divided
# by the side's share; KV usage is a ratio of each side's own budget.
LIVE_METRICS: tuple[MetricSpec, ...] = (
    *_LATENCIES,
    MetricSpec(
        "preemptions_per_request", Direction.INCREASE, tolerance_ratio=0.2, tolerance_abs=0.05
    ),
    _GOODPUT,
    _ERRORS,
    KV_USAGE_INFO,
)


@dataclass(frozen=True, slots=True)
class MetricVerdict:
    """One metric's comparison."""

    name: str
    verdict: Verdict
    counts_against: bool
    p_value: float | None
    shift: float | None  # Hodges-Lehmann: canary minus baseline
    baseline_median: float | None
    canary_median: float | None
    baseline_count: int
    canary_count: int
    reason: str


@dataclass(frozen=True, slots=True)
class Judgement:
    """The whole canary's verdict."""

    classification: Classification
    score_ratio: float
    metrics: tuple[MetricVerdict, ...]
    reason: str

    @property
    def promote(self) -> bool:
        return self.classification is Classification.PASS


@dataclass(frozen=True, slots=True)
class JudgeConfig:
    """Thresholds: `pass_score_ratio` and up passes, `marginal_score_ratio` and up is marginal."""

    metrics: tuple[MetricSpec, ...] = DEFAULT_METRICS
    alpha: float = 0.05
    pass_score_ratio: float = 0.95
    marginal_score_ratio: float = 0.75


def judge(
    canary: Mapping[str, Sequence[float]],
    baseline: Mapping[str, Sequence[float]],
    config: JudgeConfig | None = None,
    slo_limits: Mapping[str, float] | None = None,
) -> Judgement:
    """Compare the canary's samples with the baseline's, metric by metric.

    `slo_limits` maps a metric's name to the SLO's limit for it (see `slo_tolerance_ratio`).
    """
    config = config or JudgeConfig()
    limits = slo_limits or {}
    verdicts = tuple(
        judge_metric(
            spec,
            canary.get(spec.name, ()),
            baseline.get(spec.name, ()),
            config.alpha,
            slo_limit=limits.get(spec.name),
        )
        for spec in config.metrics
    )
    weights = {spec.name: spec.weight for spec in config.metrics if spec.counted}
    judged = [v for v in verdicts if v.verdict is not Verdict.NODATA and v.name in weights]
    total = sum(weights[v.name] for v in judged)
    if total == 0:
        return Judgement(Classification.FAIL, 0.0, verdicts, "no metric had enough samples")
    good = sum(weights[v.name] for v in judged if not v.counts_against)
    score = good / total
    critical = {spec.name for spec in config.metrics if spec.critical}
    broken = [v.name for v in verdicts if v.counts_against and v.name in critical]
    against = [f"{v.name} {v.verdict}" for v in verdicts if v.counts_against]
    if broken:
        return Judgement(
            Classification.FAIL, score, verdicts, f"critical metric failed: {', '.join(broken)}"
        )
    if score >= config.pass_score_ratio:
        classification = Classification.PASS
    elif score >= config.marginal_score_ratio:
        classification = Classification.MARGINAL
    else:
        classification = Classification.FAIL
    info = [
        f"{v.name} {v.verdict}"
        for v in verdicts
        if v.name not in weights and v.verdict in (Verdict.HIGH, Verdict.LOW)
    ]
    reason = f"score {score:.0%}" + (f"; against: {', '.join(against)}" if against else "")
    reason += f"; shown, not counted: {', '.join(info)}" if info else ""
    return Judgement(classification, score, verdicts, reason)


def judge_metric(
    spec: MetricSpec,
    canary: Sequence[float],
    baseline: Sequence[float],
    alpha: float,
    *,
    slo_limit: float | None = None,
) -> MetricVerdict:
    """One metric's verdict (see the module docstring)."""
    n_c, n_b = len(canary), len(baseline)
    if n_c < spec.min_samples or n_b < spec.min_samples:
        return MetricVerdict(
            spec.name, Verdict.NODATA, False, None, None,
            _median(baseline), _median(canary), n_b, n_c,
            f"too few samples (canary {n_c}, baseline {n_b}; {spec.min_samples} needed)",
        )  # fmt: skip
    from scipy.stats import mannwhitneyu

    base_median, canary_median = statistics.median(baseline), statistics.median(canary)
    if len(set(canary) | set(baseline)) == 1:
        p_value = 1.0  # identical constant samples: the test is undefined, there is no shift
    else:
        p_value = float(mannwhitneyu(canary, baseline, alternative="two-sided").pvalue)
    shift = _hodges_lehmann(canary, baseline)
    band = max(spec.tolerance_abs, spec.tolerance_ratio * abs(base_median))
    if slo_limit is not None:
        band = max(band, spec.slo_tolerance_ratio * slo_limit)
    if p_value >= alpha:
        verdict, reason = Verdict.PASS, f"no significant difference (p={p_value:.3g})"
    elif abs(shift) <= band:
        verdict, reason = Verdict.PASS, f"shift {shift:+.3g} within tolerance ±{band:.3g}"
    else:
        verdict = Verdict.HIGH if shift > 0 else Verdict.LOW
        reason = f"shift {shift:+.3g} beyond tolerance ±{band:.3g} (p={p_value:.3g})"
    against = spec.counted and (
        (verdict is Verdict.HIGH and spec.direction != Direction.DECREASE)
        or (verdict is Verdict.LOW and spec.direction != Direction.INCREASE)
    )
    return MetricVerdict(
        spec.name, verdict, against, p_value, shift, base_median, canary_median, n_b, n_c, reason
    )


def _hodges_lehmann(canary: Sequence[float], baseline: Sequence[float]) -> float:
    """Median of all pairwise differences, on at most 400 x 400 evenly spaced order statistics."""
    a, b = _thin(sorted(canary)), _thin(sorted(baseline))
    return statistics.median(x - y for x in a for y in b)


def _thin(values: list[float], limit: int = 400) -> list[float]:
    if len(values) <= limit:
        return values
    step = (len(values) - 1) / (limit - 1)
    return [values[round(i * step)] for i in range(limit)]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None
