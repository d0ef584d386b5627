"""The canary judge: a canary passes only on evidence that it is not worse.

Each metric is judged by its kind (`MetricKind`): latencies and goodput as samples (one per
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
whole judgement INCONCLUSIVE, and so does a NaN or an infinity in any counted metric's data
(no data, never a pass); a latency without data is left out and said. A critical metric
that counts against fails the whole; otherwise the score (the weighted share of judged
metrics that do not count against the canary) tells MARGINAL from FAIL. Only PASS promotes.

Over windows (`judge.windows`) latencies and goodput are judged per window (latencies by the
window's p95) on log ratios, so margins are multiplicative; errors (margin: half a point)
and preemptions per finished request are pooled counts deflated by their over-dispersion
across windows.

The judge counts only what users feel: latencies, preemptions, errors and goodput. KV usage
is the memory knob's own consequence (a smaller budget fills more of itself at equal
service), so it is compared and shown but never counted (`MetricSpec.counted`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from kvpilot.tuner.judge import evidence
from kvpilot.tuner.judge.evidence import Samples
from kvpilot.tuner.judge.metric import NON_FINITE, MetricTest
from kvpilot.tuner.judge.vocabulary import Direction as Direction
from kvpilot.tuner.judge.vocabulary import MetricKind as MetricKind
from kvpilot.tuner.judge.vocabulary import MetricSpec as MetricSpec
from kvpilot.tuner.judge.vocabulary import MetricVerdict as MetricVerdict
from kvpilot.tuner.judge.vocabulary import Verdict as Verdict


class Classification(StrEnum):
    PASS = "pass"  # noqa: S105 (a verdict, not a password)
    MARGINAL = "marginal"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


# What users feel, judged alike on replay and on live traffic: latencies, errors, goodput.
# Over windows each latency is the window's p95 (its tail: a preemption stall slows a few
# requests a lot, which a median never sees), compared as a ratio (x1.1 is the margin).
_LATENCIES: tuple[MetricSpec, ...] = (
    MetricSpec(
        "ttft_s",
        Direction.INCREASE,
        tolerance_ratio=0.1,
        tolerance_abs=0.005,
        slo_tolerance_ratio=0.1,
        window_quantile=0.95,
    ),
    MetricSpec(
        "inter_token_s",
        Direction.INCREASE,
        tolerance_ratio=0.1,
        tolerance_abs=0.001,
        slo_tolerance_ratio=0.1,
        window_quantile=0.95,
    ),
    MetricSpec("e2e_s", Direction.INCREASE, tolerance_ratio=0.1, tolerance_abs=0.01),
)
# The latencies' names: `tuning.latency_margin_ratio` sets their margins together.
LATENCY_METRICS: tuple[str, ...] = tuple(spec.name for spec in _LATENCIES)
_GOODPUT = MetricSpec(
    "goodput_tokens_per_s", Direction.DECREASE, tolerance_ratio=0.1, required=True
)
# Half a percentage point: with zero failures on both sides, about 550 requests a side show
# it at alpha 0.05 (Wilson's bound of 0 in n is 2.7/n); 1 % against 0 % never passes.
ERROR_MARGIN = 0.005
_ERRORS = MetricSpec(
    "errors_ratio",
    Direction.INCREASE,
    tolerance_abs=ERROR_MARGIN,
    critical=True,
    kind=MetricKind.PROPORTION,
    required=True,
)
# Information only: a smaller KV budget fills more of itself; that is the saving, not a harm.
KV_USAGE_INFO = MetricSpec(
    "kv_usage_ratio", Direction.INCREASE, tolerance_ratio=0.25, tolerance_abs=0.05, counted=False
)

# Preemptions per finished request (a per-second rate rewards a canary that finishes
# slower): a fifth of the baseline's, at least one per hundred requests; with none on both
# sides about 300 requests a side show it.
PREEMPTIONS_PER_REQUEST = MetricSpec(
    "preemptions_per_request",
    Direction.INCREASE,
    tolerance_ratio=0.2,
    tolerance_abs=0.01,
    kind=MetricKind.RATE,
    required=True,
)

# Replay: both sides get the whole workload.
DEFAULT_METRICS: tuple[MetricSpec, ...] = (
    *_LATENCIES,
    PREEMPTIONS_PER_REQUEST,
    _GOODPUT,
    _ERRORS,
    KV_USAGE_INFO,
)


# Live traffic splits it unevenly: per-request and per-share figures compare, totals do not
# (a canary on 10 % sees a tenth of the preemptions). Each side is judged at the rate it
# receives: the splitter, not the server, sets how many requests a side gets, so its
# generation rate divided by its share measures the split as much as the server, and one
# interval's rate swings with the arrivals in it. It is shown, not counted; the latencies
# say whether a side keeps up with what it gets, and TTFT (every request has one) is
# required, as errors and preemptions are. KV usage is a ratio of each side's own budget.
LIVE_METRICS: tuple[MetricSpec, ...] = (
    replace(_LATENCIES[0], required=True),
    *_LATENCIES[1:],
    MetricSpec(
        "preemptions_per_request",
        Direction.INCREASE,
        tolerance_ratio=0.2,
        tolerance_abs=0.1,
        kind=MetricKind.RATE,
        required=True,
    ),
    replace(_GOODPUT, required=False, counted=False),
    _ERRORS,
    KV_USAGE_INFO,
)


def with_margins(metrics: Sequence[MetricSpec], **margins: float) -> tuple[MetricSpec, ...]:
    """`metrics` with the named ones' absolute margins (`tolerance_abs`) changed: a rig of
    few requests (a CPU test, the demo) cannot show half a point of errors and says how much
    it can. An unknown name is an error, not a silent no-op."""
    names = {m.name for m in metrics}
    unknown = sorted(set(margins) - names)
    if unknown:
        raise ValueError(
            f"no such metric: {', '.join(unknown)} (known: {', '.join(sorted(names))})"
        )
    return tuple(
        replace(m, tolerance_abs=margins[m.name]) if m.name in margins else m for m in metrics
    )


def with_margin_ratios(metrics: Sequence[MetricSpec], **ratios: float) -> tuple[MetricSpec, ...]:
    """`metrics` with the named ones' relative margins (`tolerance_ratio`) changed: x1.5 for
    a latency whose rise the operator accepts. A metric whose decrease is bad (goodput) takes
    a ratio below 1; an unknown name is an error, not a silent no-op."""
    by_name = {m.name: m for m in metrics}
    unknown = sorted(set(ratios) - set(by_name))
    if unknown:
        raise ValueError(
            f"no such metric: {', '.join(unknown)} (known: {', '.join(sorted(by_name))})"
        )
    for name, ratio in ratios.items():
        if not ratio > 0 or (by_name[name].direction is Direction.DECREASE and ratio >= 1):
            raise ValueError(f"{name}: a margin ratio must be above 0 (and below 1 for a loss)")
    return tuple(
        replace(m, tolerance_ratio=ratios[m.name]) if m.name in ratios else m for m in metrics
    )


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
        MetricTest.run(
            spec,
            canary.get(spec.name, ()),
            baseline.get(spec.name, ()),
            config.alpha,
            limits.get(spec.name),
        )
        for spec in config.metrics
    ]
    return judge_tests(config, tests)


def judge_tests(config: JudgeConfig, tests: Sequence[MetricTest]) -> Judgement:
    """The verdict over every metric's tests: Holm's procedure over the counted metrics'
    harm tests, then the classification (see the module docstring)."""
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
    test = MetricTest.run(spec, canary, baseline, alpha, slo_limit)
    return test.verdict(_harmed(test, alpha))


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
    missing = [
        v.name
        for v in verdicts
        if v.verdict is Verdict.NODATA
        and (specs[v.name].required or v.reason.startswith(NON_FINITE))
    ]
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


def _harmed(test: MetricTest, alpha: float) -> bool:
    return test.harm_p is not None and test.harm_p < alpha
