"""The measure: regret against the memory-priced best, and the goals, per landscape.

* A cell's score is the table's (`tuner_replay.ScoreKind`): goodput, or capacity at the SLO
  for a table with `capacity_rps`.
* The memory-priced best of a table: among its feasible cells (pooled truth) within 5 % of
  the best score, the one with the least KV budget (then the higher score).
* What a strategy recommends after k trials: the same rule over what it observed (a cell
  tried more than once counts its mean score, and is feasible when most of its windows
  were), so every strategy is judged by one rule, not by its own.
* Regret of a recommendation r against the best b: 1 - min(1, score_r / score_b,
  kv_b / kv_r), where score and feasibility are r's pooled truth, not the window the
  strategy saw; 1 when r is infeasible or nothing was recommended. Memory over the best
  counts as lost share: at an equal score, twice the best's KV budget is a regret of 0.5.
  "Within 95 %" is a regret of at most 0.05.
* The noise floor: the mean regret of a search that measured every cell once (one drawn
  ladder or window a cell, 200 draws) and made the memory-priced choice on what it saw:
  what the noise alone costs. A table with one measurement a cell shows none (0).
* Server starts: one a trial, plus auto_tune's descent.
* Significance across landscapes, not seeds: each landscape gives one figure per strategy
  (its mean regret at 8 trials over the seeds), and a one-sided Wilcoxon signed-rank test
  pairs the figures by landscape.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tuner_noise import Key, NoisyTable, draw
from tuner_replay import GOODPUT, ScoreKind, Table
from tuner_strategies import RUNNERS, Run, Trial

MEMORY_TIE_RATIO = 0.05
WITHIN_REGRET = 0.05
GOAL_TRIALS = 8
GOAL_SHARE = 0.80
MIN_LANDSCAPES = 6
FLOOR_DRAWS = 200


def memory_priced(cells: Mapping[Key, tuple[float, bool]]) -> Key | None:
    """Least KV among feasible cells within 5 % of the best score; None if none feasible."""
    feasible = {k: score for k, (score, ok) in cells.items() if ok}
    if not feasible:
        return None
    top = max(feasible.values())
    near = [k for k, score in feasible.items() if score >= (1 - MEMORY_TIE_RATIO) * top]
    return min(near, key=lambda k: (k[0], -feasible[k]))


def best_of(table: Table) -> Key | None:
    """The table's memory-priced best, from its pooled truth."""
    return memory_priced({k: (c.score or 0.0, c.feasible) for k, c in table.items()})


def recommend(trials: Sequence[Trial]) -> Key | None:
    """What a strategy would recommend after these trials (the same rule for all)."""
    seen: dict[Key, list[Trial]] = {}
    for trial in trials:
        seen.setdefault(trial.key, []).append(trial)
    return memory_priced(
        {
            key: (
                statistics.fmean(t.drawn.score or 0.0 for t in group),
                2 * sum(t.drawn.feasible for t in group) > len(group),
            )
            for key, group in seen.items()
        }
    )


def regret(table: Table, best: Key, chosen: Key | None) -> float:
    """1 - min(1, score share, memory share); 1 for no or an infeasible recommendation."""
    if chosen is None or not table[chosen].feasible:
        return 1.0
    share = (table[chosen].score or 0.0) / (table[best].score or 1)
    return 1.0 - min(1.0, share, best[0] / chosen[0])


def noise_floor(noisy: NoisyTable, draws: int = FLOOR_DRAWS) -> float:
    """The mean regret of the memory-priced choice over one drawn window of every cell (see
    the module docstring): a perfect search's regret against this table's noise."""
    table: Table = {key: cell.truth for key, cell in noisy.items()}
    best = best_of(table)
    if best is None:
        return 1.0
    regrets = []
    for seed in range(draws):
        seen = {key: draw(cell, seed, key, 0) for key, cell in noisy.items()}
        chosen = memory_priced({k: (d.score or 0.0, d.feasible) for k, d in seen.items()})
        regrets.append(regret(table, best, chosen))
    return statistics.fmean(regrets)


@dataclass(frozen=True, slots=True)
class Figures:
    """One strategy on one landscape, over the seeds."""

    regret: dict[int, tuple[float, ...]]  # trials -> regret per seed
    starts: tuple[int, ...]  # starts over the whole budget, per seed
    starts_to_match: tuple[float, ...]  # starts until auto_tune's result; inf: never

    def mean_regret(self, trials: int) -> float:
        return statistics.fmean(self.regret[trials])

    def within(self, trials: int) -> float:
        return sum(r <= WITHIN_REGRET for r in self.regret[trials]) / len(self.regret[trials])


@dataclass(frozen=True, slots=True)
class Landscape:
    """One replayed landscape: its best and every strategy's figures."""

    name: str
    cells: int
    feasible: int
    best: Key
    best_score: float
    top: Key  # the best score, memory not priced
    top_score: float
    figures: dict[str, Figures]
    score_kind: ScoreKind = GOODPUT
    noise_floor: float = 0.0  # `noise_floor`: the regret the table's noise alone costs


def _starts_to(run: Run, table: Table, best: Key, target: float) -> float:
    for k in range(1, len(run.trials) + 1):
        if regret(table, best, recommend(run.trials[:k])) <= target + 1e-9:
            return float(run.starts_after(k))
    return math.inf


def replay_landscape(
    name: str,
    noisy: NoisyTable,
    seeds: int,
    checkpoints: Sequence[int],
    strategies: Sequence[str],
    *,
    score_kind: ScoreKind = GOODPUT,
) -> Landscape:
    """Every strategy, `seeds` runs each, for max(checkpoints) trials; `score_kind` says what
    the cells' score is (`tuner_noise.score_kind`)."""
    table: Table = {key: cell.truth for key, cell in noisy.items()}
    best = best_of(table)
    assert best is not None, "the caller replays only tables with a feasible cell"
    budget = max(checkpoints)
    runs = {s: [RUNNERS[s](noisy, seed, budget) for seed in range(seeds)] for s in strategies}
    anchor = [regret(table, best, recommend(r.trials)) for r in runs.get("auto_tune", [])]
    figures = {}
    for strategy, done in runs.items():
        figures[strategy] = Figures(
            regret={
                k: tuple(regret(table, best, recommend(r.trials[:k])) for r in done)
                for k in checkpoints
            },
            starts=tuple(r.starts_after(budget) for r in done),
            starts_to_match=tuple(
                _starts_to(r, table, best, a) for r, a in zip(done, anchor, strict=False)
            ),
        )
    feasible = {k: c.score or 0.0 for k, c in table.items() if c.feasible}
    top = max(feasible, key=lambda k: feasible[k])
    return Landscape(
        name=name,
        cells=len(table),
        feasible=len(feasible),
        best=best,
        best_score=feasible[best],
        top=top,
        top_score=feasible[top],
        figures=figures,
        score_kind=score_kind,
        noise_floor=noise_floor(noisy),
    )


def paired_p(ours: Sequence[float], theirs: Sequence[float]) -> float | None:
    """One-sided Wilcoxon signed-rank p that ours < theirs, paired; None under 6 pairs."""
    from scipy.stats import wilcoxon

    if len(ours) < MIN_LANDSCAPES:
        return None
    if all(math.isclose(a, b) for a, b in zip(ours, theirs, strict=True)):
        return 1.0
    return float(wilcoxon(ours, theirs, alternative="less").pvalue)
