"""One metric's two tests, by its kind: whether the canary is shown not worse than the
baseline by the metric's margin (non-inferiority), and whether it is worse at all (harm,
whose p-value the judge corrects with Holm's procedure over the counted metrics)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.tuner.judge import evidence
from kvpilot.tuner.judge.evidence import Counts, Samples
from kvpilot.tuner.judge.vocabulary import Direction, MetricKind, MetricSpec, MetricVerdict, Verdict

# The start of the reason of a metric whose data held a NaN or an infinity: no data, and the
# judge never passes a canary with it (`judgement._classify`).
NON_FINITE = "non-finite samples"


@dataclass(frozen=True, slots=True)
class MetricTest:
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
    ) -> MetricTest:
        if spec.kind is MetricKind.SHIFT:
            c, b = _values(spec, canary), _values(spec, baseline)
            bad = non_finite(c) + non_finite(b)
            if bad:
                return cls.unusable(spec, alpha, f"{NON_FINITE} ({bad}): no data")
            return cls._samples(spec, c, b, alpha, slo_limit)
        bad = sum(non_finite(s) for s in (canary, baseline) if not isinstance(s, Counts))
        if bad:
            return cls.unusable(spec, alpha, f"{NON_FINITE} ({bad}): no data")
        return cls._counts(spec, _counts(canary), _counts(baseline), alpha, slo_limit)

    @classmethod
    def unusable(cls, spec: MetricSpec, alpha: float, why: str) -> MetricTest:
        """A metric whose data cannot be judged, with the reason."""
        return cls(spec, alpha, None, None, 0, 0, missing=why)

    @classmethod
    def log_ratio(
        cls,
        spec: MetricSpec,
        canary: Sequence[float],
        baseline: Sequence[float],
        alpha: float,
        *,
        paired: bool,
    ) -> MetricTest:
        """Per-window summaries (positive) compared on the log scale, so the margin is a
        ratio: the canary is not worse when its level is within `tolerance_ratio` of the
        baseline's (x1.1 for a latency, x0.9 for goodput). Paired windows by Wilcoxon's
        signed-rank test of the log ratios, others by Mann-Whitney U of the logs. The shift
        reported is the relative change (0.25: 25 % higher), the margin the ratio."""
        n_c, n_b = len(canary), len(baseline)
        base = cls(spec, alpha, _median(baseline), _median(canary), n_b, n_c)
        if min(n_c, n_b) < spec.min_samples or (paired and n_c != n_b):
            return _replace(base, missing=_too_few(spec, n_c, n_b))
        if spec.direction is Direction.EITHER:  # both ways: the additive test on the summaries
            if paired:
                return cls.paired(spec, canary, baseline, alpha, None)
            return cls._samples(spec, canary, baseline, alpha, None)
        lc = [math.log(max(x, _FLOOR)) for x in canary]
        lb = [math.log(max(x, _FLOOR)) for x in baseline]
        sign = -1.0 if spec.direction is Direction.DECREASE else 1.0
        ratio = spec.tolerance_ratio
        bound = math.log(1 + ratio) if sign > 0 else -math.log(1 - ratio)
        if paired:
            diffs = [c - b for c, b in zip(lc, lb, strict=True)]
            bad = [sign * d for d in diffs]
            harm = evidence.signed_rank_p(bad, "greater")
            noninferior = evidence.signed_rank_p([d - bound for d in bad], "less")
            centre = statistics.median(diffs)
        else:
            bad_c, bad_b = [sign * x for x in lc], [sign * x for x in lb]
            harm = evidence.shift_harm_p(bad_c, bad_b)
            noninferior = evidence.shift_noninferior_p(bad_c, bad_b, bound)
            centre = _hodges_lehmann(lc, lb)
        return _replace(
            base,
            shift=math.exp(centre) - 1,
            margin=ratio,
            harm_p=harm,
            noninferior_p=noninferior,
        )

    @classmethod
    def _samples(
        cls,
        spec: MetricSpec,
        canary: Sequence[float],
        baseline: Sequence[float],
        alpha: float,
        slo_limit: float | None,
    ) -> MetricTest:
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
    def paired(
        cls,
        spec: MetricSpec,
        canary: Sequence[float],
        baseline: Sequence[float],
        alpha: float,
        slo_limit: float | None,
    ) -> MetricTest:
        """One summary per window a side, the windows run at the same time: each pair's
        difference is one sample (the windows' conditions cancel within a pair), tested with
        Wilcoxon's signed-rank test."""
        n = min(len(canary), len(baseline))
        base = cls(spec, alpha, _median(baseline), _median(canary), len(baseline), len(canary))
        if len(canary) != len(baseline) or n < spec.min_samples:
            return _replace(base, missing=_too_few(spec, len(canary), len(baseline)))
        margin = _margin(spec, abs(statistics.median(baseline)), slo_limit)
        diffs = [c - b for c, b in zip(canary, baseline, strict=True)]
        shift = statistics.median(diffs)
        if spec.direction is Direction.EITHER:
            up = evidence.signed_rank_p(diffs, "greater")
            down = evidence.signed_rank_p(diffs, "less")
            equivalent = max(
                evidence.signed_rank_p([d - margin for d in diffs], "less"),
                evidence.signed_rank_p([d + margin for d in diffs], "greater"),
            )
            harm = min(1.0, 2 * min(up, down))
            return _replace(base, shift=shift, margin=margin, harm_p=harm, noninferior_p=equivalent)
        sign = -1.0 if spec.direction is Direction.DECREASE else 1.0
        bad = [sign * d for d in diffs]
        return _replace(
            base,
            shift=shift,
            margin=margin,
            harm_p=evidence.signed_rank_p(bad, "greater"),
            noninferior_p=evidence.signed_rank_p([d - margin for d in bad], "less"),
        )

    @classmethod
    def _counts(
        cls,
        spec: MetricSpec,
        canary: Counts | None,
        baseline: Counts | None,
        alpha: float,
        slo_limit: float | None,
    ) -> MetricTest:
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
        if spec.kind is MetricKind.PROPORTION:
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


# Summaries are floored here before their logs: a window without goodput is a very large
# loss, not a window without data.
_FLOOR = 1e-9


def non_finite(values: Sequence[float]) -> int:
    """How many of `values` are NaN or infinite."""
    return sum(1 for v in values if not math.isfinite(v))


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


def _replace(test: MetricTest, **changes: object) -> MetricTest:
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
