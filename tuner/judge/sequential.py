"""Group-sequential looks at a canary: judge at 8, 16, 32 and 64 windows, stop at the first
look that decides.

Each look spends a share of the judge's `alpha` (Lan-DeMets spending: Pocock's by default,
which spends it about evenly and so lets a clearly bad canary stop early; O'Brien-Fleming's
keeps nearly all of it for the last look). A look's tests run at the alpha it spends: the
looks' statistics are positively correlated, so treating each look's share as if the looks
were independent is conservative (the family's error stays at or below `alpha`).

A look PASSes (every counted metric shown within its margin), FAILs (something counted
shown worse beyond its margin, a marginal judgement too: a clearly bad canary stops here)
or CONTINUEs to the next look; the last look that does neither is INCONCLUSIVE, with about
how many more windows would decide it. Screening looks (fewer windows than the plan's first
look) may reject and never promote.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvpilot.tuner.judge import evidence
from kvpilot.tuner.judge.judgement import Classification, JudgeConfig, Judgement
from kvpilot.tuner.judge.vocabulary import MetricVerdict, Verdict
from kvpilot.tuner.judge.windows import Window, judge_windows

# The looks a side's windows are judged at by default, and so the most windows a trial
# observes a side: ONE default for the library and the agent.
DEFAULT_LOOKS: tuple[int, ...] = (8, 16, 32, 64)
DEFAULT_WINDOWS = DEFAULT_LOOKS[-1]


class Spending(StrEnum):
    POCOCK = "pocock"
    OBRIEN_FLEMING = "obrien-fleming"


# Something counted shown worse beyond its margin (critical or not): the canary stops here.
_SHOWN_WORSE = (Classification.FAIL, Classification.MARGINAL)


class LookDecision(StrEnum):
    PASS = "pass"  # noqa: S105 (a decision, not a password)
    FAIL = "fail"
    CONTINUE = "continue"
    INCONCLUSIVE = "inconclusive"


def looks_for(windows: int) -> tuple[int, ...]:
    """The default looks up to `windows`, ending at it: 64 gives 8/16/32/64, 20 gives 8/16/20,
    5 gives one look at 5."""
    if windows < 1:
        raise ValueError(f"a look needs at least one window, not {windows}")
    return (*(n for n in DEFAULT_LOOKS if n < windows), windows)


@dataclass(frozen=True, slots=True)
class LookPlan:
    """When to look and how to spend alpha over the looks."""

    looks: tuple[int, ...] = DEFAULT_LOOKS
    spending: Spending = Spending.POCOCK

    def __post_init__(self) -> None:
        if not self.looks or any(b <= a for a, b in zip(self.looks, self.looks[1:], strict=False)):
            raise ValueError(f"looks must be increasing window counts, not {self.looks}")
        if self.looks[0] < 1:
            raise ValueError("a look needs at least one window")

    def alphas(self, alpha: float) -> tuple[float, ...]:
        """Each look's share of `alpha` (they sum to it)."""
        last = self.looks[-1]
        spent = [evidence.spent_alpha(n / last, alpha, self.spending) for n in self.looks]
        return tuple(b - a for a, b in zip([0.0, *spent[:-1]], spent, strict=True))


@dataclass(frozen=True, slots=True)
class Look:
    """One look's judgement and what it decides; `more_windows`: for an inconclusive last
    look, about how many more windows a side would decide it (None: no estimate)."""

    windows: int
    alpha: float
    judgement: Judgement
    decision: LookDecision
    more_windows: int | None = None

    def summary(self) -> str:
        head = f"{self.decision.value} at {self.windows} windows (alpha {self.alpha:.3g})"
        if self.decision is LookDecision.INCONCLUSIVE:  # the classification says "inconclusive"
            more = (
                f"about {self.more_windows} more windows needed"
                if self.more_windows is not None
                else "more windows may not help: the estimate lies beyond the margin"
            )
            head = f"{more} (at {self.windows} windows, alpha {self.alpha:.3g})"
        return f"{head}: {self.judgement.reason}"


def judge_look(
    windows: Sequence[Window],
    plan: LookPlan,
    config: JudgeConfig | None = None,
    slo_limits: Mapping[str, float] | None = None,
    *,
    paired: bool = True,
) -> Look:
    """Judge the windows so far at the look they reach (see the module docstring)."""
    config = config or JudgeConfig()
    n = len(windows)
    alphas = plan.alphas(config.alpha)
    reached = [i for i, at in enumerate(plan.looks) if at <= n]
    if not reached:  # screening: the first look's alpha, and never a pass
        alpha = alphas[0]
        judgement = judge_windows(windows, config, slo_limits, paired=paired, alpha=alpha)
        if judgement.classification in _SHOWN_WORSE:
            return Look(n, alpha, judgement, LookDecision.FAIL)
        return Look(
            n, alpha, _not_passed(judgement, "screening never promotes"), LookDecision.CONTINUE
        )
    index = reached[-1]
    alpha = alphas[index]
    judgement = judge_windows(windows, config, slo_limits, paired=paired, alpha=alpha)
    if judgement.classification is Classification.PASS:
        return Look(n, alpha, judgement, LookDecision.PASS)
    if judgement.classification in _SHOWN_WORSE:
        return Look(n, alpha, judgement, LookDecision.FAIL)
    if index < len(plan.looks) - 1:
        return Look(n, alpha, judgement, LookDecision.CONTINUE)
    look = Look(n, alpha, judgement, LookDecision.INCONCLUSIVE, more_windows(judgement, n, alpha))
    return dataclasses.replace(
        look, judgement=dataclasses.replace(judgement, reason=look.summary())
    )


def more_windows(judgement: Judgement, windows: int, alpha: float) -> int | None:
    """About how many more windows a side would show the unsure metrics within their
    margins, if their estimates held: evidence grows with the square root of the windows, so
    a non-inferiority z of z_now needs (z_need / z_now)^2 times the windows, and a count's
    bound narrows the same way. None when an estimate lies at or beyond its margin."""
    from scipy.stats import norm

    need = 0.0
    z_need = float(norm.ppf(1 - alpha))
    for verdict in judgement.metrics:
        if verdict.verdict is not Verdict.INCONCLUSIVE:
            continue
        factor = _growth(verdict, z_need)
        if factor is None:
            return None
        need = max(need, factor)
    if need <= 1:
        return None
    return max(1, math.ceil(windows * need) - windows)


def _growth(verdict: MetricVerdict, z_need: float) -> float | None:
    from scipy.stats import norm

    margin, shift = verdict.margin, verdict.shift
    if verdict.upper_bound is not None and margin is not None and shift is not None:
        width, room = verdict.upper_bound - shift, margin - shift
        return (width / room) ** 2 if room > 0 and width > 0 else None
    p = verdict.noninferior_p
    if p is None or p >= 0.5:
        return None
    z_now = float(norm.ppf(1 - p))
    return (z_need / z_now) ** 2


def _not_passed(judgement: Judgement, why: str) -> Judgement:
    if judgement.classification is not Classification.PASS:
        return judgement
    reason = f"{why} ({judgement.reason})"
    return dataclasses.replace(judgement, classification=Classification.INCONCLUSIVE, reason=reason)
