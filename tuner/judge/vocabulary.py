"""The judge's vocabulary: how a metric is judged (`MetricSpec`) and what came of it
(`MetricVerdict`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Direction(StrEnum):
    """Which change of a metric is bad."""

    INCREASE = "increase"
    DECREASE = "decrease"
    EITHER = "either"


class MetricKind(StrEnum):
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
    kind: MetricKind = MetricKind.SHIFT
    required: bool = False  # True: without data the canary cannot pass
    # Over windows, samples are summarised per window by this quantile (0.95: the window's
    # tail, where preemption stalls show) and compared as log ratios, the margin
    # multiplicative (`tolerance_ratio`; `tolerance_abs` and the SLO's share are for the
    # request-level judge of fewer windows).
    window_quantile: float = 0.5


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
