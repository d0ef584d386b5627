"""The canary judge: a canary passes only on evidence that it is not worse.

Each metric is judged by its kind (`Kind`): latencies and goodput as samples (one per
request, or per interval where the window gives no requests) with Mann-Whitney U tests of
a location shift; errors as a proportion of requests (Fisher's exact test, Newcombe's bound);
preemptions as a rate of events over requests or seconds (the conditional binomial test of
two Poisson counts, a MOVER bound from Garwood's). Two questions per metric:

* **Not worse by more than the margin** (non-inferiority): the margin is `tolerance_ratio`
  of the baseline's level, at least `tolerance_abs`, and at least `slo_tolerance_ratio` of the
  SLO's limit for the metric where the caller gives one (a larger batch may double a 3 ms
  inter-token gap; with a 100 ms limit that is not worth rolling back). A PASS is this shown
  at `alpha`. Every counted metric must pass for the canary to pass: an intersection-union
  test, so the family needs no correction to keep its level.
* **Worse** (harm): one-sided tests, Holm's step-down over the counted metrics keeps the
  family-wise false-fail rate at `alpha`. A metric counts against the canary (HIGH, or LOW
  for a metric whose decrease is bad) when its harm is significant after Holm and the
  estimated change is beyond the margin.

What is neither shown not worse nor shown worse is INCONCLUSIVE: too little evidence, which
never promotes. Missing data on a `required` metric (errors, goodput, preemptions) makes the
whole judgement INCONCLUSIVE; a latency without data is left out and said. A critical metric
that counts against fails the whole; otherwise the score (the weighted share of judged
metrics that do not count against the canary) tells MARGINAL from FAIL. Only PASS promotes.

The judge counts only what users feel: latencies, preemptions, errors and goodput. KV usage
is the memory knob's own consequence (a smaller budget fills more of itself at equal
service), so it is compared and shown but never counted (`MetricSpec.counted`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvpilot.tuner import evidence
from kvpilot.tuner.evidence import Counts, Samples


class Direction(StrEnum):
    """Which change of a metric is bad."""

    INCREASE = "increase"
    DECREASE = "decrease"
    EITHER = "either"


class Kind(StrEnum):
    """How a metric's data are tested."""

    SHIFT = "shift"  # samples: Mann-Whitney U on a location shift
    PROPORTION = "proportion"  # events of trials: Fisher's exact test, Newcombe's bound
    RATE = "rate"  # event counts over an exposure: Poisson tests


class Verdict(StrEnum):
    PASS = "pass"  # noqa: S105 (a verdict, not a password)
    HIGH = "high"
    LOW = "low"
    INCONCLUSIVE = "inconclusive"
    NODATA = "nodata"


class Classification(StrEnum):
    PASS = "pass"  # noqa: S105 (a verdict, not a password)
    MARGINAL = "marginal"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """How one metric is judged."""

    name: str
    direction: Direction
    tolerance_ratio: float = 0.1
    tolerance_abs: float = 0.0
    weight: float = 1.0
    critical: bool = False
    min_samples: int = 5  # samples, or the exposure of counts
    slo_tolerance_ratio: float = 0.0  # of the SLO's limit for this metric, when one is given
    counted: bool = True  # False: compared and shown as information, never in the score
    kind: Kind = Kind.SHIFT
    required: bool = False  # True: without data the canary cannot pass


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
_GOODPUT = MetricSpec(
    "goodput_tokens_per_s", Direction.DECREASE, tolerance_ratio=0.1, required=True
)
# Five percentage points: zero failures in about 55 requests a side shows it at alpha 0.05.
_ERRORS = MetricSpec(
    "errors_ratio",
    Direction.INCREASE,
    tolerance_abs=0.05,
    critical=True,
    kind=Kind.PROPORTION,
    required=True,
)
# Information only: a smaller KV budget fills more of itself; that is the saving, not a harm.
KV_USAGE_INFO = MetricSpec(
    "kv_usage_ratio", Direction.INCREASE, tolerance_ratio=0.25, tolerance_abs=0.05, counted=False
)

# Replay: both sides get the whole workload, so per-second rates compare.
DEFAULT_METRICS: tuple[MetricSpec, ...] = (
    *_LATENCIES,
    MetricSpec(
        "preemptions_per_s",
        Direction.INCREASE,
        tolerance_ratio=0.2,
        tolerance_abs=0.2,
        kind=Kind.RATE,
        required=True,
    ),
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
        "preemptions_per_request",
        Direction.INCREASE,
        tolerance_ratio=0.2,
        tolerance_abs=0.1,
        kind=Kind.RATE,
        required=True,
    ),
    _GOODPUT,
    _ERRORS,
    KV_USAGE_INFO,
)


@dataclass(frozen=True, slots=True)
class MetricVerdict:
    """One metric's comparison; for proportions and rates the medians are the rates."""

    name: str
    verdict: Verdict
    counts_against: bool
    p_value: float | None  # the harm test's, as given (Holm's adjustment is in the verdict)
    shift: float | None  # canary minus baseline: Hodges-Lehmann, or the rates' difference
    baseline_median: float | None
    canary_median: float | None
    baseline_count: int
    canary_count: int
    reason: str
    margin: float | None = None  # how much worse counts as not worse
    noninferior_p: float | None = None  # samples: H0 "worse by the margin or more"
    upper_bound: float | None = None  # counts: the bound of the bad-way difference


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
    """`alpha`: each non-inferiority test's level, and the family-wise level of the harm
    tests; a score of `marginal_score_ratio` and up, with something against, is marginal."""

    metrics: tuple[MetricSpec, ...] = DEFAULT_METRICS
    alpha: float = 0.05
    marginal_score_ratio: float = 0.75


def judge(
    canary: Mapping[str, Samples],
    baseline: Mapping[str, Samples],
    config: JudgeConfig | None = None,
    slo_limits: Mapping[str, float] | None = None,
) -> Judgement:
    """Compare the canary with the baseline, metric by metric (see the module docstring).

    `slo_limits` maps a metric's name to the SLO's limit for it (see `slo_tolerance_ratio`).
    """
    config = config or JudgeConfig()
    limits = slo_limits or {}
    tests = [
        _Test.run(
            spec,
            canary.get(spec.name, ()),
            baseline.get(spec.name, ()),
            config.alpha,
            limits.get(spec.name),
        )
        for spec in config.metrics
    ]
    family = {t.spec.name: t.harm_p for t in tests if t.spec.counted and t.harm_p is not None}
    worse = evidence.holm(family, config.alpha)
    verdicts = tuple(
        t.verdict(t.spec.name in worse if t.spec.counted else _harmed(t, config.alpha))
        for t in tests
    )
    return _classify(config, verdicts)


def judge_metric(
    spec: MetricSpec,
    canary: Samples,
    baseline: Samples,
    alpha: float,
    *,
    slo_limit: float | None = None,
) -> MetricVerdict:
    """One metric's verdict, as a family of one (see the module docstring)."""
    test = _Test.run(spec, canary, baseline, alpha, slo_limit)
    return test.verdict(_harmed(test, alpha))


@dataclass(frozen=True, slots=True)
class _Test:
    """One metric's two tests, before Holm's procedure says whether its harm stands."""

    spec: MetricSpec
    alpha: float
    baseline_level: float | None
    canary_level: float | None
    baseline_count: int
    canary_count: int
    shift: float | None = None
    margin: float | None = None
    harm_p: float | None = None
    noninferior_p: float | None = None
    upper_bound: float | None = None
    missing: str | None = None

    @classmethod
    def run(
        cls,
        spec: MetricSpec,
        canary: Samples,
        baseline: Samples,
        alpha: float,
        slo_limit: float | None,
    ) -> _Test:
        if spec.kind is Kind.SHIFT:
            c, b = _values(spec, canary), _values(spec, baseline)
            return cls._samples(spec, c, b, alpha, slo_limit)
        return cls._counts(spec, _counts(canary), _counts(baseline), alpha, slo_limit)

    @classmethod
    def _samples(
        cls,
        spec: MetricSpec,
        canary: Sequence[float],
        baseline: Sequence[float],
        alpha: float,
        slo_limit: float | None,
    ) -> _Test:
        n_c, n_b = len(canary), len(baseline)
        base = cls(spec, alpha, _median(baseline), _median(canary), n_b, n_c)
        if n_c < spec.min_samples or n_b < spec.min_samples:
            return _replace(base, missing=_too_few(spec, n_c, n_b))
        margin = _margin(spec, abs(statistics.median(baseline)), slo_limit)
        shift = _hodges_lehmann(canary, baseline)
        if spec.direction is Direction.EITHER:
            up = evidence.shift_harm_p(canary, baseline)
            down = evidence.shift_harm_p([-x for x in canary], [-x for x in baseline])
            harm = min(1.0, 2 * min(up, down))
            equivalent = max(
                evidence.shift_noninferior_p(canary, baseline, margin),
                evidence.shift_noninferior_p([-x for x in canary], [-x for x in baseline], margin),
            )
            return _replace(base, shift=shift, margin=margin, harm_p=harm, noninferior_p=equivalent)
        sign = -1.0 if spec.direction is Direction.DECREASE else 1.0
        bad_c, bad_b = [sign * x for x in canary], [sign * x for x in baseline]
        return _replace(
            base,
            shift=shift,
            margin=margin,
            harm_p=evidence.shift_harm_p(bad_c, bad_b),
            noninferior_p=evidence.shift_noninferior_p(bad_c, bad_b, margin),
        )

    @classmethod
    def _counts(
        cls,
        spec: MetricSpec,
        canary: Counts | None,
        baseline: Counts | None,
        alpha: float,
        slo_limit: float | None,
    ) -> _Test:
        n_c = round(canary.exposure) if canary else 0
        n_b = round(baseline.exposure) if baseline else 0
        r_c = canary.rate if canary else None
        r_b = baseline.rate if baseline else None
        base = cls(spec, alpha, r_b, r_c, n_b, n_c)
        if canary is None or baseline is None or r_c is None or r_b is None:
            return _replace(base, missing=_too_few(spec, n_c, n_b))
        if n_c < spec.min_samples or n_b < spec.min_samples:
            return _replace(base, missing=_too_few(spec, n_c, n_b))
        margin = _margin(spec, r_b, slo_limit)
        if spec.kind is Kind.PROPORTION:
            harm = evidence.proportion_harm_p(canary, baseline)
            upper = evidence.proportion_difference_upper(canary, baseline, alpha)
        else:
            harm = evidence.rate_harm_p(canary, baseline)
            upper = evidence.rate_difference_upper(canary, baseline, alpha)
        return _replace(base, shift=r_c - r_b, margin=margin, harm_p=harm, upper_bound=upper)

    @property
    def noninferior(self) -> bool:
        if self.upper_bound is not None and self.margin is not None:
            return self.upper_bound < self.margin
        return self.noninferior_p is not None and self.noninferior_p < self.alpha

    def verdict(self, harmed: bool) -> MetricVerdict:
        """The verdict, given whether the harm test stands (after Holm, for the counted)."""
        spec = self.spec
        if self.missing is not None or self.shift is None or self.margin is None:
            return self._out(Verdict.NODATA, False, self.missing or "no data")
        evidence_text = self._evidence()
        if self.noninferior:
            within = (
                f"within the margin ±{self.margin:.3g}"
                if spec.direction is Direction.EITHER
                else f"not worse by {self.margin:.3g} or more"
            )
            return self._out(Verdict.PASS, False, f"{within} ({evidence_text})")
        bad = {Direction.INCREASE: self.shift, Direction.DECREASE: -self.shift}.get(
            spec.direction, abs(self.shift)
        )
        if harmed and bad > self.margin:
            verdict = Verdict.HIGH if self.shift > 0 else Verdict.LOW
            against = spec.counted
            text = f"worse by {self.shift:+.3g}, beyond the margin {self.margin:.3g}"
            return self._out(verdict, against, f"{text} ({evidence_text})")
        text = f"not shown within the margin {self.margin:.3g}: insufficient evidence"
        return self._out(Verdict.INCONCLUSIVE, False, f"{text} ({evidence_text})")

    def _evidence(self) -> str:
        parts = [f"shift {self.shift:+.3g}"]
        if self.upper_bound is not None:
            parts.append(f"upper bound {self.upper_bound:+.3g}")
        if self.noninferior_p is not None:
            parts.append(f"non-inferiority p={self.noninferior_p:.3g}")
        if self.harm_p is not None:
            parts.append(f"harm p={self.harm_p:.3g}")
        return ", ".join(parts)

    def _out(self, verdict: Verdict, against: bool, reason: str) -> MetricVerdict:
        return MetricVerdict(
            self.spec.name,
            verdict,
            against,
            self.harm_p,
            self.shift,
            self.baseline_level,
            self.canary_level,
            self.baseline_count,
            self.canary_count,
            reason,
            margin=self.margin,
            noninferior_p=self.noninferior_p,
            upper_bound=self.upper_bound,
        )


def _classify(config: JudgeConfig, verdicts: tuple[MetricVerdict, ...]) -> Judgement:
    specs = {spec.name: spec for spec in config.metrics}
    weights = {spec.name: spec.weight for spec in config.metrics if spec.counted}
    judged = [v for v in verdicts if v.name in weights and v.verdict is not Verdict.NODATA]
    total = sum(weights[v.name] for v in judged)
    good = sum(weights[v.name] for v in judged if not v.counts_against)
    score = good / total if total else 0.0
    broken = [v.name for v in verdicts if v.counts_against and specs[v.name].critical]
    against = [f"{v.name} {v.verdict}" for v in verdicts if v.counts_against]
    info = [
        f"{v.name} {v.verdict}"
        for v in verdicts
        if v.name not in weights and v.verdict in (Verdict.HIGH, Verdict.LOW)
    ]
    shown = f"; shown, not counted: {', '.join(info)}" if info else ""
    if broken:
        reason = f"critical metric failed: {', '.join(broken)}"
        return Judgement(Classification.FAIL, score, verdicts, reason)
    if against:
        marginal = score >= config.marginal_score_ratio
        classification = Classification.MARGINAL if marginal else Classification.FAIL
        reason = f"score {score:.0%}; against: {', '.join(against)}{shown}"
        return Judgement(classification, score, verdicts, reason)
    missing = [v.name for v in verdicts if v.verdict is Verdict.NODATA and specs[v.name].required]
    unsure = [v.name for v in judged if v.verdict is Verdict.INCONCLUSIVE]
    if total == 0 or missing or unsure:
        why = [f"no data on {', '.join(missing)}"] if missing else []
        why += [f"not shown within the margin: {', '.join(unsure)}"] if unsure else []
        why = why or ["no metric had enough samples"]
        reason = f"insufficient evidence: {'; '.join(why)}{shown}"
        return Judgement(Classification.INCONCLUSIVE, score, verdicts, reason)
    left_out = [v.name for v in verdicts if v.verdict is Verdict.NODATA and v.name in weights]
    reason = f"score {score:.0%}; every judged metric within its margin"
    reason += f"; left out for want of data: {', '.join(left_out)}" if left_out else ""
    return Judgement(Classification.PASS, score, verdicts, reason + shown)


def _harmed(test: _Test, alpha: float) -> bool:
    return test.harm_p is not None and test.harm_p < alpha


def _margin(spec: MetricSpec, level: float, slo_limit: float | None) -> float:
    margin = max(spec.tolerance_abs, spec.tolerance_ratio * abs(level))
    if slo_limit is not None:
        margin = max(margin, spec.slo_tolerance_ratio * slo_limit)
    return margin


def _values(spec: MetricSpec, samples: Samples) -> Sequence[float]:
    if isinstance(samples, Counts):
        raise TypeError(f"{spec.name} is judged on samples, not counts")
    return samples


def _counts(samples: Samples) -> Counts | None:
    """Counts as given; samples (one 0/1 per request, or events per unit) summed."""
    if isinstance(samples, Counts):
        return samples
    return Counts(float(sum(samples)), float(len(samples))) if samples else None


def _too_few(spec: MetricSpec, n_c: int, n_b: int) -> str:
    return f"too few samples (canary {n_c}, baseline {n_b}; {spec.min_samples} needed)"


def _replace(test: _Test, **changes: object) -> _Test:
    return dataclasses.replace(test, **changes)  # type: ignore[arg-type]


def _hodges_lehmann(canary: Sequence[float], baseline: Sequence[float]) -> float:
    """Median of all pairwise differences, on at most 400 x 400 evenly spaced order statistics."""
    import numpy as np

    a, b = _thin(sorted(canary)), _thin(sorted(baseline))
    return float(np.median(np.subtract.outer(a, b)))


def _thin(values: list[float], limit: int = 400) -> list[float]:
    if len(values) <= limit:
        return values
    step = (len(values) - 1) / (limit - 1)
    return [values[round(i * step)] for i in range(limit)]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None
