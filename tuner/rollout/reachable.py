"""Whether a rollout's settings let a canary pass at all, asked of the judge itself before a
run spends its trials, restarts and GPU time.

The best case is a canary equal to the stable: each window the same latencies and goodput on
both sides, no errors, no preemptions, the configured requests a window. It is judged as the
rollout judges (`judge_look` at each look of the plan, paired: a parallel canary's windows
run at the same time, a sequential one's candidate windows are paired with the stable's
before and after them (A-B-A, `tuner.rollout.bracket`); the configured metrics, margins and
alpha; the sequential baseline's doubled requests are not counted: a little stricter). A
run whose best case passes at no look can only roll back or end inconclusive: it is refused,
with the judge's reason and what would make it reachable (the fewest `tuning.windows` that pass, the
error margin it would need).

Identical values would not be the best case but a degenerate one: the rank tests treat ties
by approximations that can claim more than any real, continuous data could (Mann-Whitney U of
two tied blocks beats complete separation of distinct values). So the best case carries a
tiny deterministic spread: every value distinct (a part in a thousand at most, far inside
any margin), the canary's windows a hair above or below the baseline's in turn. Its
latencies then separate completely from the margin's edge, the real data's best.

Live traffic judges one analysis of intervals: its latencies by the intervals the analysis
holds, its errors and preemptions by the users' requests, whose number no one knows before
the run; those counts are given ample requests here (exempt), the intervals are checked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.tuner.judge.evidence import Counts, Samples
from kvpilot.tuner.judge.judgement import Classification, JudgeConfig, Judgement, with_margins
from kvpilot.tuner.judge.sequential import Look, LookDecision, judge_look
from kvpilot.tuner.judge.vocabulary import MetricKind, MetricSpec, MetricVerdict, Verdict
from kvpilot.tuner.judge.windows import MIN_WINDOWS, Window
from kvpilot.tuner.rollout.record import Strategy
from kvpilot.tuner.rollout.settings import RolloutSettings

# `tuning.windows` is searched up to its largest allowed value.
MOST_WINDOWS = 256
ERRORS = "errors_ratio"
# Live traffic's counts are the users' requests: the best case gives them this many a side.
_AMPLE_REQUESTS = 1_000_000
# The largest relative spread of the best case's values (see the module docstring).
_SPREAD = 1e-3


@dataclass(frozen=True, slots=True)
class Reachability:
    """Whether an equal canary can pass under the settings, and if not, why and what would.

    `look`: the best case's first passing look, else its last; `blockers`: the counted
    metrics that keep it from passing there, in words. `windows_needed`: the fewest
    `tuning.windows` (up to 256) whose best case passes, None when none does or the windows
    are not the question (live traffic). `error_margin_needed`: the error margin under which
    the configured windows pass, None when the margin is not what stops them."""

    passes: bool
    look: Look
    blockers: tuple[str, ...]
    requests_per_window: int | None  # None: live traffic, judged over `intervals`
    paired: bool
    intervals: int | None = None
    windows_needed: int | None = None
    error_margin_needed: float | None = None

    @property
    def reason(self) -> str:
        """In an operator's words: what stops the best case, and what would let it pass."""
        if self.requests_per_window is not None:
            how = "paired windows" if self.paired else "unpaired windows"
            load = f"{self.requests_per_window} requests a window, {how}"
        else:
            load = f"live traffic, {self.intervals} intervals of one analysis"
        head = (
            "an equal canary (the stable's latencies and goodput, no errors, no preemptions; "
            f"{load})"
        )
        if self.passes:
            return f"{head} passes at the look of {self.look.windows} windows"
        why = "; ".join(self.blockers) or self.look.judgement.reason
        cures = []
        if self.windows_needed is not None:
            cures.append(f"tuning.windows {self.windows_needed} or more")
        if self.error_margin_needed is not None:
            cures.append(f"tuning.error_margin_ratio {self.error_margin_needed:g} or more")
        if self.requests_per_window is not None:
            cures.append("more requests a window (tuning.workload.requests)")
        else:
            cures.append("a longer canary.analysis_s (or a shorter analysis_interval_s)")
        n = self.look.windows
        where = (
            f"at {n} window{'s' if n > 1 else ''} a side"
            if self.requests_per_window is not None
            else "over the analysis"
        )
        return (
            f"cannot pass: {head} is not shown within the margins {where} ({why}); "
            f"it would be with {' or '.join(cures)}"
        )


def reachability(
    settings: RolloutSettings,
    *,
    requests_per_window: int,
    strategy: Strategy,
    search_windows: bool = True,
) -> Reachability:
    """Whether an equal canary can pass a replayed rollout under `settings` with
    `requests_per_window` a window and `strategy`'s pairing (see the module docstring).
    `search_windows`: look for the fewest windows that would pass (a refused run's advice;
    up to seconds where it lies far beyond the configured windows)."""
    if requests_per_window < 1:
        raise ValueError(f"a window sends at least one request, not {requests_per_window}")
    paired = strategy in (Strategy.PARALLEL, Strategy.SEQUENTIAL)  # both judge paired
    look = best_look(settings, requests_per_window=requests_per_window, paired=paired)
    found = Reachability(
        look.decision is LookDecision.PASS,
        look,
        _blockers(look, settings.judge.metrics),
        requests_per_window,
        paired,
    )
    if found.passes:
        return found
    return dataclasses.replace(
        found,
        windows_needed=(
            _fewest_windows(settings, requests_per_window, paired) if search_windows else None
        ),
        error_margin_needed=_error_margin(settings, requests_per_window, paired),
    )


def live_reachability(settings: RolloutSettings, *, intervals: int) -> Reachability:
    """Whether an equal canary can pass a live analysis of `intervals` intervals a side,
    judged as the rollout judges it (`tuner.rollout.intervals`): each interval pair one
    window of one sample, paired, and fewer than MIN_WINDOWS pairs never judged; errors and
    preemptions given ample requests."""
    if intervals < 1:
        raise ValueError(f"an analysis holds at least one interval, not {intervals}")
    if intervals < MIN_WINDOWS:
        judgement = Judgement(
            Classification.INCONCLUSIVE,
            0.0,
            (),
            f"{intervals} intervals, fewer than the {MIN_WINDOWS} a paired judgement needs",
        )
        look = Look(intervals, settings.judge.alpha, judgement, LookDecision.INCONCLUSIVE)
        return Reachability(False, look, (judgement.reason,), None, True, intervals=intervals)
    counts = _AMPLE_REQUESTS // intervals
    windows = [
        _window(settings.judge.metrics, k, intervals, 1, counts=counts) for k in range(intervals)
    ]
    plan, limits = settings.look_plan, settings.slo.judge_limits()
    look = judge_look(windows, plan, settings.judge, limits, paired=True)
    passes = look.decision is LookDecision.PASS
    blockers = _blockers(look, settings.judge.metrics)
    return Reachability(passes, look, blockers, None, paired=True, intervals=intervals)


def best_look(settings: RolloutSettings, *, requests_per_window: int, paired: bool) -> Look:
    """The judge's look at the best case: the first look that passes, else the last."""
    windows = best_case(settings.judge.metrics, settings.windows, requests_per_window)
    return _first_pass(windows, settings, paired=paired)


def best_case(metrics: Sequence[MetricSpec], windows: int, requests: int) -> list[Window]:
    """An equal canary's `windows` windows of `requests` requests (see the module docstring)."""
    return [_window(metrics, k, windows, requests, counts=requests) for k in range(windows)]


def _window(
    metrics: Sequence[MetricSpec], k: int, windows: int, samples: int, *, counts: int
) -> Window:
    # Window k's values rise by a hair with k and, within the window, with the request; the
    # canary's window sits a smaller hair above or below the baseline's, in turn.
    step = _SPREAD / (2 * windows * samples)
    base = [1.0 + step * (k * samples + i) for i in range(samples)]
    tilt = math.exp((-1) ** k * (k + 1) * step / 4)
    canary: dict[str, Samples] = {}
    baseline: dict[str, Samples] = {}
    for spec in metrics:
        if spec.kind is MetricKind.SHIFT:
            baseline[spec.name] = tuple(base)
            canary[spec.name] = tuple(v * tilt for v in base)
        else:  # a proportion or a rate: no events in the window's requests
            baseline[spec.name] = canary[spec.name] = Counts(0.0, float(counts))
    return Window(canary, baseline)


def _first_pass(windows: Sequence[Window], settings: RolloutSettings, *, paired: bool) -> Look:
    plan = settings.look_plan
    limits = settings.slo.judge_limits()
    look: Look | None = None
    for at in plan.looks:
        look = judge_look(windows[:at], plan, settings.judge, limits, paired=paired)
        if look.decision is LookDecision.PASS:
            return look
    assert look is not None  # a plan has at least one look
    return look


def _fewest_windows(settings: RolloutSettings, requests: int, paired: bool) -> int | None:
    for windows in range(settings.windows + 1, MOST_WINDOWS + 1):
        tried = dataclasses.replace(settings, windows=windows)
        if best_look(tried, requests_per_window=requests, paired=paired).decision is (
            LookDecision.PASS
        ):
            return windows
    return None


def _error_margin(settings: RolloutSettings, requests: int, paired: bool) -> float | None:
    """The error margin under which the configured windows' best case passes: the errors'
    bound at a look where nothing else stops it, rounded up, and checked."""
    windows = best_case(settings.judge.metrics, settings.windows, requests)
    plan, limits = settings.look_plan, settings.slo.judge_limits()
    bounds = []
    for at in plan.looks:
        look = judge_look(windows[:at], plan, settings.judge, limits, paired=paired)
        unsure = _unsure(look, settings.judge.metrics)
        if [v.name for v in unsure] == [ERRORS] and unsure[0].upper_bound is not None:
            bounds.append(unsure[0].upper_bound)
    if not bounds:
        return None
    margin = _round_up(min(bounds))
    metrics = with_margins(settings.judge.metrics, **{ERRORS: margin})
    judge = JudgeConfig(metrics, settings.judge.alpha, settings.judge.marginal_score_ratio)
    tried = dataclasses.replace(settings, judge=judge)
    passes = best_look(tried, requests_per_window=requests, paired=paired).decision
    return margin if passes is LookDecision.PASS else None


def _round_up(bound: float) -> float:
    """The bound rounded up to two significant digits (the caller checks that it passes)."""
    digits = 1 - math.floor(math.log10(bound))
    scale = 10.0**-digits
    return round((math.floor(bound / scale) + 1) * scale, digits)


def _unsure(look: Look, metrics: Sequence[MetricSpec]) -> list[MetricVerdict]:
    """The counted metrics that keep the best case from passing at `look`."""
    counted = {spec.name for spec in metrics if spec.counted}
    return [
        v
        for v in look.judgement.metrics
        if v.name in counted and v.verdict in (Verdict.INCONCLUSIVE, Verdict.NODATA)
    ]


def _blockers(look: Look, metrics: Sequence[MetricSpec]) -> tuple[str, ...]:
    return tuple(_blocker(v, look.alpha) for v in _unsure(look, metrics))


def _blocker(verdict: MetricVerdict, alpha: float) -> str:
    if verdict.verdict is Verdict.NODATA:
        return f"{verdict.name}: {verdict.reason}"
    if verdict.upper_bound is not None and verdict.margin is not None:
        n = verdict.baseline_count
        what = "failures" if verdict.name == ERRORS else "events"
        return (
            f"{verdict.name}: with no {what} in {n} requests a side its bound is "
            f"{verdict.upper_bound:.2g}, above the margin {verdict.margin:.3g}"
        )
    p = f"{verdict.noninferior_p:.2g}" if verdict.noninferior_p is not None else "unknown"
    return (
        f"{verdict.name}: {verdict.baseline_count} samples a side show it within its margin "
        f"at p={p} at best, not below the look's alpha {alpha:.2g}"
    )
