"""Replay the tables and print the measure, the goals per landscape, and the paired tests.

The goals, judged on each landscape, for the project's BayesianSuggester:

1. at 8 trials, within 95 % of the memory-priced best in at least 80 % of runs;
2. fewer server starts than auto_tune for the same result: the median over seeds of the
   starts until its recommendation's regret is no worse than auto_tune's final one (same
   seed), below auto_tune's median starts; never within the budget counts as infinite;
3. a lower mean regret at 8 trials than Optuna's GP sampler with constraints.

A goal that cannot be judged (Optuna missing, a table incomplete) is printed as such, never
as met. The landscapes are the measured tables and, unless `--mirror none`, each table with
its KV axis reversed; a mirror reuses the same measurements, and the paired tests count it
as a landscape of its own, which the output says.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tuner_noise import (
    CAPACITY_COLUMN,
    Key,
    NoisyTable,
    TableError,
    full_grid,
    load_noisy,
    mirrored,
    rows_of,
    score_kind,
)
from tuner_regret import GOAL_SHARE, GOAL_TRIALS, Landscape, paired_p, replay_landscape
from tuner_replay import (
    CAPACITY,
    excluded_passes,
    load_table,
    measured_seconds,
    missing_cells,
    pass_cells,
)
from tuner_strategies import OPTUNA_STRATEGIES, STRATEGIES, optuna_missing

ANCHOR = "bayesian"


@dataclass(frozen=True, slots=True)
class Source:
    """A table to replay: its name, path, the grid it must cover (None: its own levels), and
    the command that would measure what it lacks."""

    name: str
    path: Path
    grid: Sequence[Key] | None
    finish: str


@dataclass(frozen=True, slots=True)
class Goal:
    label: str
    met: bool | None  # None: not judged
    detail: str

    def line(self, landscape: str) -> str:
        word = {True: "met", False: "NOT met", None: "not judged"}[self.met]
        return f"  goal {landscape}, {self.label}: {word} ({self.detail})"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _starts(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:g}"


def goals(ls: Landscape, missing_optuna: str | None) -> list[Goal]:
    """The three goals on one landscape."""
    ours = ls.figures[ANCHOR]
    share = ours.within(GOAL_TRIALS)
    out = [
        Goal(
            f"within 95 % at {GOAL_TRIALS} trials in >= {GOAL_SHARE:.0%} of runs",
            share >= GOAL_SHARE,
            f"{share:.0%} of runs",
        )
    ]
    auto = ls.figures.get("auto_tune")
    if auto is None:
        out.append(Goal("fewer starts than auto_tune", None, "auto_tune not run"))
    else:
        mine, theirs = _median(ours.starts_to_match), _median(auto.starts)
        out.append(
            Goal(
                "fewer starts than auto_tune for its result",
                mine < theirs,
                f"median {_starts(mine)} starts against auto_tune's {_starts(theirs)}",
            )
        )
    gp = ls.figures.get("optuna-gp")
    if gp is None:
        out.append(Goal("lower regret than optuna-gp", None, missing_optuna or "not run"))
    else:
        mine_r, theirs_r = ours.mean_regret(GOAL_TRIALS), gp.mean_regret(GOAL_TRIALS)
        out.append(
            Goal(
                f"lower regret than optuna-gp at {GOAL_TRIALS} trials",
                mine_r < theirs_r,
                f"mean {mine_r:.3f} against {theirs_r:.3f}",
            )
        )
    return out


def report(ls: Landscape, checkpoints: Sequence[int], missing_optuna: str | None) -> list[str]:
    """The lines printed for one landscape."""
    kib, score = 1024, ls.score_kind

    def at(key: Key) -> str:
        return f"kv={key[0] // kib} KiB seqs={key[1]}"

    lines = [
        f"landscape {ls.name}: {ls.cells} cells, {ls.feasible} feasible; best {score.name} "
        f"{score.text(ls.top_score)} at {at(ls.top)}; memory-priced best "
        f"{score.text(ls.best_score)} at {at(ls.best)}; noise floor {ls.noise_floor:.3f}",
        "  "
        + f"{'strategy':<11}"
        + "".join(f"{f'regret@{k}':>10}" for k in checkpoints)
        + f"{f'within@{GOAL_TRIALS}':>10}{'starts':>8}  starts to auto_tune's result",
    ]
    for strategy, fig in ls.figures.items():
        share = f"{fig.within(GOAL_TRIALS):.0%}" if GOAL_TRIALS in fig.regret else "-"
        lines.append(
            "  "
            + f"{strategy:<11}"
            + "".join(f"{fig.mean_regret(k):>10.3f}" for k in checkpoints)
            + f"{share:>10}{_median(fig.starts):>8g}  "
            + ("-" if strategy == "auto_tune" else _starts(_median(fig.starts_to_match)))
        )
    if missing_optuna:
        lines.append(f"  {', '.join(OPTUNA_STRATEGIES)}: not run: {missing_optuna}")
    lines.extend(goal.line(ls.name) for goal in goals(ls, missing_optuna))
    return lines


def summary(done: Sequence[Landscape], mirrors: bool, missing_optuna: str | None) -> list[str]:
    """Per landscape, the mean regret at 8 trials and the goals; then the paired tests."""
    if not done:
        return ["no landscape replayed"]
    names = list(done[0].figures)
    width = max(17, *(len(ls.name) for ls in done))  # a table's name may be its file's
    lines = [
        f"across {len(done)} landscape(s), mean regret at {GOAL_TRIALS} trials, one figure a "
        "landscape, each against the memory-priced best of its own score, beside its noise "
        "floor (what a search that measured every cell once pays to the table's noise)"
        + (
            "; a '-mirrored' landscape is a measured table with its KV axis reversed, the same "
            "measurements, counted as a landscape of its own in the tests below"
            if mirrors
            else ""
        ),
        f"  {'landscape':<{width}} {'score':<9}{'floor':>7}"
        + "".join(f"{n:>11}" for n in names)
        + "  goals 1 2 3",
    ]
    for ls in done:
        marks = " ".join(
            {True: "met", False: "NOT", None: "n/a"}[g.met] for g in goals(ls, missing_optuna)
        )
        lines.append(
            f"  {ls.name:<{width}} {ls.score_kind.name:<9}{ls.noise_floor:>7.3f}"
            + "".join(f"{ls.figures[n].mean_regret(GOAL_TRIALS):>11.3f}" for n in names)
            + f"  {marks}"
        )
    ours = [ls.figures[ANCHOR].mean_regret(GOAL_TRIALS) for ls in done]
    for other in names:
        if other == ANCHOR:
            continue
        theirs = [ls.figures[other].mean_regret(GOAL_TRIALS) for ls in done]
        lower = sum(a < b for a, b in zip(ours, theirs, strict=True))
        p = paired_p(ours, theirs)
        test = (
            f"one-sided Wilcoxon signed-rank p = {p:.3g}"
            if p is not None
            else f"no test: {len(done)} landscape(s), fewer than 6"
        )
        lines.append(f"  {ANCHOR} < {other}: {test} (lower on {lower} of {len(done)} landscapes)")
    return lines


def prepared(source: Source, passes: set[int] | None) -> tuple[NoisyTable | None, list[str]]:
    """The table's cells on its grid, from the complete passes; or why it is not judged."""
    name, path = source.name, source.path
    if not path.is_file():
        why = f"no table at {path}; measure with: {source.finish}"
        return None, [f"landscape {name}: not judged ({why})"]
    grid = source.grid or full_grid(load_table(path))
    # Only complete passes are pooled (a pass measured in part, at another time and load,
    # would favour the cells it reached), and none the header sets aside.
    counts, excluded = pass_cells(path, grid), excluded_passes(path)
    if passes is not None:
        excluded |= {n: "not asked for" for n in counts if n not in passes}
    complete = {n for n, c in counts.items() if c == len(grid) and n not in excluded}
    note = ", ".join(
        f"pass {n}: {cells} of {len(grid)} cells"
        + ("" if n in complete else f", not used ({excluded.get(n, 'incomplete')})")
        for n, cells in sorted(counts.items())
    )
    lines = [f"landscape {name}: windows pooled over the complete passes ({note})"]
    if score_kind(path) == CAPACITY:
        lines.append(
            f"  scored by capacity at the SLO ({CAPACITY_COLUMN}, req/s), memory priced: "
            "the least KV budget within 5 % of the best capacity; a trial draws one ladder"
        )
    if passes is not None and not complete:
        return None, [*lines, f"  {name}: not judged (no complete pass among those asked for)"]
    noisy = {k: c for k, c in load_noisy(path, complete or None).items() if k in grid}
    missing = missing_cells({k: c.truth for k, c in noisy.items()}, grid)
    if missing:
        why = f"table incomplete: {len(missing)} cell(s) not measured; finish with: {source.finish}"
        return None, [*lines, f"  {name}: not judged ({why})"]
    if not any(c.truth.feasible for c in noisy.values()):
        return None, [*lines, f"  {name}: not judged (no feasible cell)"]
    timing = measured_seconds(path, complete)
    if timing is not None:
        lines.append(
            f"  measured: {timing[0] / 60:.1f} min of windows, server starts "
            f"{timing[1] / 60:.1f} min (shared by the landscapes of a cell)"
        )
    return noisy, lines


def replay_tables(
    sources: Sequence[Source],
    seeds: int,
    checkpoints: Sequence[int] = (4, 8, 16),
    mirror: str = "both",
    passes: set[int] | None = None,
) -> int:
    """Replay every source (and its mirror); 2 when a table cannot be read."""
    started = time.monotonic()
    missing_optuna = optuna_missing()
    strategies = [s for s in STRATEGIES if not (missing_optuna and s in OPTUNA_STRATEGIES)]
    done: list[Landscape] = []
    for source in sources:
        try:
            rows_of(source.path) if source.path.is_file() else None
            noisy, lines = prepared(source, passes)
        except TableError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
        print("\n".join(lines), flush=True)
        if noisy is None:
            continue
        kind = score_kind(source.path)
        variants = [(source.name, noisy)] if mirror != "only" else []
        if mirror != "none":
            variants.append((f"{source.name}-mirrored", mirrored(noisy)))
        for name, table in variants:
            ls = replay_landscape(name, table, seeds, checkpoints, strategies, score_kind=kind)
            print("\n".join(report(ls, checkpoints, missing_optuna)), flush=True)
            done.append(ls)
    print("\n".join(summary(done, mirror != "none", missing_optuna)))
    print(f"replayed {seeds} seeds per strategy in {time.monotonic() - started:.0f} s")
    return 0
