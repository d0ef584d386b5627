"""The judge's statistical tests, one pair per kind of metric: a harm test (is the canary
worse at all?) and a non-inferiority test (is it shown to be worse by less than the margin?).

Directions are taken as "an increase is bad": the caller negates samples for a metric whose
decrease is bad. Bounds of differences of proportions and of Poisson rates are MOVER
(Newcombe's hybrid score for proportions from Wilson's bounds, the same recovery of variance
from Garwood's exact bounds for rates): both stay honest at zero events, where a Wald
interval collapses to a point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Counts:
    """Events over an exposure: failed of answered requests, or preemptions over finished
    requests (or seconds). A judge's input where a metric is a proportion or a rate."""

    events: float
    exposure: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.events) and math.isfinite(self.exposure)):
            raise ValueError("counts must be finite")
        if self.events < 0 or self.exposure < 0:
            raise ValueError("counts must not be negative")

    @property
    def rate(self) -> float | None:
        return self.events / self.exposure if self.exposure > 0 else None


# A metric's data for the judge: its samples, or its events over an exposure.
Samples = Sequence[float] | Counts


def shift_harm_p(canary: Sequence[float], baseline: Sequence[float]) -> float:
    """One-sided Mann-Whitney U: the p-value of 'the canary's values are larger'."""
    return _mwu(canary, baseline, "greater")


def shift_noninferior_p(canary: Sequence[float], baseline: Sequence[float], margin: float) -> float:
    """The p-value of H0 'the canary is larger by the margin or more' (a location shift):
    the one-sided Mann-Whitney U of the canary moved down by the margin."""
    return _mwu([c - margin for c in canary], baseline, "less")


def proportion_harm_p(canary: Counts, baseline: Counts) -> float:
    """Fisher's exact test, one-sided: the p-value of 'the canary's proportion is larger'."""
    from scipy.stats import fisher_exact

    xc, nc = _whole(canary)
    xb, nb = _whole(baseline)
    table = [[xc, nc - xc], [xb, nb - xb]]
    return float(fisher_exact(table, alternative="greater").pvalue)


def proportion_difference_upper(canary: Counts, baseline: Counts, alpha: float) -> float:
    """One-sided upper (1 - alpha) bound of canary minus baseline proportion (Newcombe)."""
    z = _z(alpha)
    xc, nc = _whole(canary)
    xb, nb = _whole(baseline)
    pc, pb = xc / nc, xb / nb
    _, upper_c = wilson_interval(xc, nc, z)
    lower_b, _ = wilson_interval(xb, nb, z)
    return pc - pb + math.hypot(upper_c - pc, pb - lower_b)


def rate_harm_p(canary: Counts, baseline: Counts) -> float:
    """The conditional binomial test of two Poisson counts: the p-value of 'the canary's rate
    is larger', given the events both sides had together."""
    from scipy.stats import binomtest

    xc, xb = round(canary.events), round(baseline.events)
    if xc + xb == 0:
        return 1.0
    share = canary.exposure / (canary.exposure + baseline.exposure)
    return float(binomtest(xc, xc + xb, share, alternative="greater").pvalue)


def rate_difference_upper(canary: Counts, baseline: Counts, alpha: float) -> float:
    """One-sided upper (1 - alpha) bound of canary minus baseline rate (MOVER, Garwood)."""
    from scipy.stats import chi2

    xc, xb = round(canary.events), round(baseline.events)
    rc, rb = xc / canary.exposure, xb / baseline.exposure
    upper_c = chi2.ppf(1 - alpha, 2 * xc + 2) / 2 / canary.exposure
    lower_b = chi2.ppf(alpha, 2 * xb) / 2 / baseline.exposure if xb > 0 else 0.0
    return rc - rb + math.hypot(upper_c - rc, rb - lower_b)


def signed_rank_p(differences: Sequence[float], alternative: str) -> float:
    """Wilcoxon's signed-rank test of paired differences: the p-value of 'they lie above
    zero' (`greater`) or 'below zero' (`less`); differences of zero carry no evidence."""
    from scipy.stats import wilcoxon

    nonzero = [d for d in differences if d != 0]
    if not nonzero:
        return 1.0
    return float(wilcoxon(nonzero, alternative=alternative).pvalue)


def holm(p_values: dict[str, float], alpha: float) -> set[str]:
    """The names whose hypotheses Holm's step-down procedure rejects at family-wise `alpha`."""
    rejected: set[str] = set()
    ordered = sorted(p_values.items(), key=lambda item: item[1])
    for rank, (name, p) in enumerate(ordered):
        if p > alpha / (len(ordered) - rank):
            break
        rejected.add(name)
    return rejected


def _mwu(a: Sequence[float], b: Sequence[float], alternative: str) -> float:
    """Mann-Whitney U's p-value as scipy's `mannwhitneyu(..., method="auto")` gives it: exact
    for small samples without ties (scipy computes it), otherwise the normal approximation
    with tie correction and continuity correction, computed here in one pass of numpy
    (scipy's wrapper costs milliseconds a call, and the judge runs it twice per metric)."""
    import numpy as np

    if len(set(a) | set(b)) == 1:
        return 1.0  # all values equal: no evidence either way
    n1, n2 = len(a), len(b)
    values = np.concatenate([np.asarray(a, dtype=float), np.asarray(b, dtype=float)])
    if min(n1, n2) <= 8 and len(np.unique(values)) == len(values):
        from scipy.stats import mannwhitneyu

        return float(mannwhitneyu(a, b, alternative=alternative).pvalue)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    # The average rank of each distinct value, 1-based.
    average = np.cumsum(counts) - (counts - 1) / 2.0
    u1 = float(average[inverse[:n1]].sum()) - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    ties = float((counts**3 - counts).sum())
    sigma = math.sqrt(n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1))))
    if sigma == 0:
        return 1.0
    mean = n1 * n2 / 2.0
    if alternative == "greater":
        return _normal_sf((u1 - mean - 0.5) / sigma)
    return _normal_sf((mean - u1 - 0.5) / sigma)


def _normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _whole(counts: Counts) -> tuple[int, int]:
    n = max(1, round(counts.exposure))
    return min(n, round(counts.events)), n


def wilson_interval(x: int, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval of x events in n trials at normal quantile z."""
    p, z2 = x / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _z(alpha: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(1 - alpha))


def dispersion(events: Sequence[float], exposures: Sequence[float], *, binomial: bool) -> float:
    """How much more the windows' counts vary than independent requests would (Pearson's
    chi-square over its degrees of freedom, at least 1): errors and preemptions cluster in
    windows (one stall preempts many), so pooled counts are deflated by it before testing,
    the quasi-likelihood way. One window, or no events, gives 1."""
    pairs = [(x, n) for x, n in zip(events, exposures, strict=True) if n > 0]
    total_x, total_n = sum(x for x, _ in pairs), sum(n for _, n in pairs)
    if len(pairs) < 2 or total_x <= 0 or total_n <= 0:
        return 1.0
    rate = total_x / total_n
    if binomial and rate >= 1:
        return 1.0
    spread = rate * (1 - rate) if binomial else rate
    chi2 = sum((x - n * rate) ** 2 / (n * spread) for x, n in pairs)
    return max(1.0, chi2 / (len(pairs) - 1))


def deflated(counts: Counts, phi: float) -> Counts:
    """The counts an over-dispersed sample is worth: events and exposure divided by `phi`."""
    return Counts(counts.events / phi, counts.exposure / phi)


def spent_alpha(fraction: float, alpha: float, spending: str) -> float:
    """Lan-DeMets alpha spending: the share of the one-sided `alpha` spent by the information
    `fraction` (0-1): "obrien-fleming" spends little early, "pocock" evenly."""
    from scipy.stats import norm

    t = min(1.0, max(0.0, fraction))
    if t == 0:
        return 0.0
    if spending == "obrien-fleming":
        return float(2 * (1 - norm.cdf(norm.ppf(1 - alpha / 2) / math.sqrt(t))))
    if spending == "pocock":
        return alpha * math.log(1 + (math.e - 1) * t)
    raise ValueError(f"unknown alpha spending {spending!r}: obrien-fleming or pocock")
