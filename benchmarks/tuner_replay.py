"""Replay measured tables: how many trials each strategy needs to reach 95 % of the best.

Strategies:

* `bayesian`: the project's BayesianSuggester, one run per seed;
* `random`: RandomSuggester, one run per seed;
* `grid`: the row-major grid (max_num_seqs outer, KV budget inner), deterministic;
* `auto_tune`: what vLLM's `benchmarks/auto_tune/auto_tune.sh` does, deterministic. That
  script first descends `--gpu-memory-utilization` from 0.98 by 0.01 until a server starts,
  then walks its `NUM_SEQS_LIST` in the order given (ascending, "128 256") with its
  `NUM_BATCHED_TOKENS_LIST` (ascending) inside, and keeps the best. The CPU build has no
  utilization fraction to descend: its KV budget is `--kv-cache-memory-bytes` (or
  VLLM_CPU_KVCACHE_SPACE), whose default is far above every budget in these tables, and the
  tables hold max-num-batched-tokens fixed. So here it walks max_num_seqs ascending at the
  table's largest KV budget (the level nearest the server's default): one trial per value.

A trial is a lookup of the asked cell; a cell is feasible when most of its windows were.
"""

from __future__ import annotations

import csv
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.tuner.objective import Outcome, TrialResult
from kvpilot.tuner.space import Candidate, Knob, KnobKind, SearchSpace
from kvpilot.tuner.suggest import (
    BayesianSuggester,
    GridSuggester,
    RandomSuggester,
    SearchExhausted,
    Suggester,
)

TARGET_RATIO = 0.95
ALPHA = 0.05


@dataclass(frozen=True, slots=True)
class Cell:
    """One measured grid cell."""

    goodput_tokens_per_s: float | None
    feasible: bool
    reason: str


Table = dict[tuple[int, int], Cell]


def load_table(path: Path, passes: set[int] | None = None) -> Table:
    """(kv_cache_memory_bytes, max_num_seqs) -> cell, from the CSV (comment lines skipped).

    A cell measured in several passes (of `passes`; default all) pools their windows: the
    median of every window's goodput, feasible when most windows were.
    """
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    rows: dict[tuple[int, int], list[dict[str, str]]] = {}
    for row in csv.DictReader(lines):
        if passes is not None and int(row.get("pass") or 1) not in passes:
            continue
        key = (int(row["kv_cache_memory_bytes"]), int(row["max_num_seqs"]))
        rows.setdefault(key, []).append(row)
    return {key: _pooled(group) for key, group in rows.items()}


def _pooled(rows: list[dict[str, str]]) -> Cell:
    if len(rows) == 1:
        row = rows[0]
        goodput = float(row["goodput_tokens_per_s"]) if row["goodput_tokens_per_s"] else None
        return Cell(goodput, row["feasible"] == "1", row["reason"])
    windows = [float(g) for r in rows for g in r["goodput_windows"].split(";") if g]
    counts = [r["windows_feasible"].split("/") for r in rows]
    feasible = 2 * sum(int(n) for n, _ in counts) > sum(int(d) for _, d in counts)
    reason = "" if feasible else next((r["reason"] for r in rows if r["reason"]), "infeasible")
    return Cell(statistics.median(windows), feasible, reason)


def reversed_kv(table: Table) -> Table:
    """The table with its KV budgets in reverse order: goodput falling as memory grows.

    No engine behaves so; it is the adversary of the Bayesian suggester's prior (a trend
    along the memory knob that may rise, never fall), replayed to show what that prior costs
    where it is wrong.
    """
    kv = sorted({k for k, _ in table})
    mirror = dict(zip(kv, reversed(kv), strict=True))
    return {(mirror[k], s): cell for (k, s), cell in table.items()}


def table_space(table: Table) -> SearchSpace:
    """The two knobs restricted to the measured levels (log scale, as the tuner uses them)."""
    kv = sorted({k for k, _ in table})
    seqs = sorted({s for _, s in table})
    return SearchSpace(
        (
            Knob(
                "kv_cache_memory_bytes",
                KnobKind.INTEGER,
                kv[0],
                kv[-1],
                log_scale=True,
                levels=tuple(kv),
            ),
            Knob(
                "max_num_seqs",
                KnobKind.INTEGER,
                seqs[0],
                seqs[-1],
                log_scale=True,
                levels=tuple(seqs),
            ),
        )
    )


def missing_cells(table: Table, grid: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """The cells of `grid` (default: the table's levels crossed) the table has no row for."""
    kv = sorted({k for k, _ in table})
    seqs = sorted({s for _, s in table})
    cells = list(grid) or [(k, s) for s in seqs for k in kv]
    return [key for key in cells if key not in table]


def _result(cell: Cell) -> TrialResult:
    if cell.feasible:
        return TrialResult(Outcome.FEASIBLE, cell.goodput_tokens_per_s, None, None)
    if cell.reason.startswith("failed to start"):
        outcome = Outcome.FAILED_TO_START
    elif "preemptions" in cell.reason:
        outcome = Outcome.PREEMPTED
    else:
        outcome = Outcome.SLO_BROKEN
    return TrialResult(outcome, cell.goodput_tokens_per_s, None, cell.reason)


def _reaches(cell: Cell, target: float) -> bool:
    return cell.feasible and (cell.goodput_tokens_per_s or 0.0) >= target


def trials_to_target(suggester: Suggester, table: Table, target: float) -> int | None:
    """Trials until a feasible cell reaches `target` goodput; None if the search ran out."""
    for trial in range(1, len(table) + 1):
        try:
            candidate = suggester.ask()
        except SearchExhausted:
            return None
        cell = table[(int(candidate["kv_cache_memory_bytes"]), int(candidate["max_num_seqs"]))]
        suggester.tell(candidate, _result(cell))
        if _reaches(cell, target):
            return trial
    return None


def auto_tune_order(table: Table) -> list[tuple[int, int]]:
    """auto_tune.sh on the CPU build: max_num_seqs ascending at the largest KV budget."""
    kv = max(k for k, _ in table)
    return [(kv, s) for s in sorted({s for _, s in table})]


def grid_order(space: SearchSpace) -> list[tuple[int, int]]:
    """The row-major grid's order, as GridSuggester walks it."""
    grid, out = GridSuggester(space), []
    while True:
        try:
            c: Candidate = grid.ask()
        except SearchExhausted:
            return out
        out.append((int(c["kv_cache_memory_bytes"]), int(c["max_num_seqs"])))


def _first_reaching(order: Sequence[tuple[int, int]], table: Table, target: float) -> int | None:
    return next((i for i, key in enumerate(order, 1) if _reaches(table[key], target)), None)


@dataclass(frozen=True, slots=True)
class Replay:
    """One landscape's replay: per-seed trials for the seeded strategies, and the grids."""

    name: str
    cells: int
    feasible: int
    best: float
    best_key: tuple[int, int]
    within: int  # feasible cells within 95 % of the best
    bayesian: tuple[int, ...]
    random: tuple[int, ...]
    grid: int
    auto_tune: int | None
    auto_tune_trials: int
    p_random: float


def replay(name: str, table: Table, seeds: int) -> Replay:
    """Every strategy over one table; a run that never reaches the target counts every cell."""
    from scipy.stats import mannwhitneyu

    space = table_space(table)
    feasible = {k: c for k, c in table.items() if c.feasible}
    best_key = max(feasible, key=lambda k: feasible[k].goodput_tokens_per_s or 0.0)
    best = feasible[best_key].goodput_tokens_per_s or 0.0
    target = TARGET_RATIO * best
    grid = _first_reaching(grid_order(space), table, target)
    assert grid is not None, "the grid walks every cell"
    auto = auto_tune_order(table)
    runs: dict[str, list[int]] = {"bayesian": [], "random": []}
    makers: dict[str, Callable[[int], Suggester]] = {
        "bayesian": lambda seed: BayesianSuggester(space, seed=seed),
        "random": lambda seed: RandomSuggester(space, seed=seed),
    }
    for seed in range(seeds):
        for strategy, make in makers.items():
            needed = trials_to_target(make(seed), table, target)
            runs[strategy].append(len(table) if needed is None else needed)
    p_random = float(mannwhitneyu(runs["bayesian"], runs["random"], alternative="less").pvalue)
    return Replay(
        name=name,
        cells=len(table),
        feasible=len(feasible),
        best=best,
        best_key=best_key,
        within=sum(_reaches(c, target) for c in table.values()),
        bayesian=tuple(runs["bayesian"]),
        random=tuple(runs["random"]),
        grid=grid,
        auto_tune=_first_reaching(auto, table, target),
        auto_tune_trials=len(auto),
        p_random=p_random,
    )


def spread(values: Sequence[int]) -> str:
    """Median, quartiles and range over seeds."""
    ordered = sorted(values)
    q1, q3 = ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]
    return (
        f"median {statistics.median(ordered):4.1f}  IQR {q1}-{q3}  range {ordered[0]}-"
        f"{ordered[-1]}  (n={len(ordered)} seeds)"
    )


def verdict(r: Replay) -> str:
    """'goal <name>: met' or 'goal <name>: NOT met (<why>)'."""
    median = statistics.median(r.bayesian)
    why = []
    if median > r.grid / 3:
        why.append(f"Bayesian median {median:g} > grid/3 = {r.grid / 3:.1f}")
        if r.grid <= 3 * 3:
            why.append(f"the grid reaches 95 % early, at trial {r.grid}")
    if not (median < statistics.median(r.random) and r.p_random < ALPHA):
        why.append(
            f"not below random (median {statistics.median(r.random):g}, "
            f"one-sided p = {r.p_random:.3g})"
        )
    if why and r.within == 1:
        why.append("a single cell within 95 % of the best")
    if why and r.within * 4 >= r.cells:
        why.append(f"flat: {r.within} of {r.cells} cells within 95 % of the best")
    return f"goal {r.name}: met" if not why else f"goal {r.name}: NOT met ({'; '.join(why)})"


def report(r: Replay, measured: tuple[float, float] | None) -> list[str]:
    """The lines printed for one landscape."""
    kv, seqs = r.best_key
    timing = (
        ""
        if measured is None
        else f"; measured: {measured[0] / 60:.1f} min of windows, server starts "
        f"{measured[1] / 60:.1f} min (shared by the landscapes of a cell)"
    )
    auto = (
        f"{r.auto_tune}"
        if r.auto_tune is not None
        else f"never (walks {r.auto_tune_trials} cells, none reaches 95 %)"
    )
    return [
        f"landscape {r.name}: {r.cells} cells, {r.feasible} feasible, best {r.best:.0f} tok/s "
        f"at kv={kv // 1024} KiB seqs={seqs}; {r.within} cell(s) within 95 %{timing}",
        f"  {'bayesian':>9}: {spread(r.bayesian)}",
        f"  {'random':>9}: {spread(r.random)}",
        f"  {'grid':>9}: {r.grid} (row-major: max_num_seqs outer, KV budget inner)",
        f"  {'auto_tune':>9}: {auto} (max_num_seqs ascending at the largest KV budget)",
        f"  Bayesian < random: one-sided Mann-Whitney U p = {r.p_random:.3g}",
        f"  {verdict(r)}",
    ]


def pass_cells(path: Path, grid: Sequence[tuple[int, int]]) -> dict[int, int]:
    """How many of the grid's cells each measurement pass holds."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    counts: dict[int, int] = {}
    for row in csv.DictReader(lines):
        if (int(row["kv_cache_memory_bytes"]), int(row["max_num_seqs"])) in grid:
            number = int(row.get("pass") or 1)
            counts[number] = counts.get(number, 0) + 1
    return counts


def excluded_passes(path: Path) -> dict[int, str]:
    """Passes the table's header sets aside, each with its reason: a comment line
    `# pass N: ...; not replayed: WHY` (the rows stay, for the record)."""
    found: dict[int, str] = {}
    for line in path.read_text().splitlines():
        match = re.match(r"# pass (\d+):.*; not replayed: (.+)$", line)
        if match:
            found[int(match.group(1))] = match.group(2).strip()
    return found


def measured_seconds(path: Path, passes: set[int]) -> tuple[float, float] | None:
    """These passes' measurement wall time: the windows, and the server starts of the cells."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    rows = [r for r in csv.DictReader(lines) if int(r.get("pass") or 1) in passes]
    if not rows or "measure_s" not in rows[0]:
        return None
    windows = sum(float(r["measure_s"] or 0) for r in rows)
    return windows, sum(float(r["server_start_s"] or 0) for r in rows)


def replay_tables(
    tables: Sequence[tuple[str, Path, str]],
    grid: Sequence[tuple[int, int]],
    seeds: int,
    reverse_kv: bool = False,
    passes: set[int] | None = None,
) -> int:
    """Replay each (name, table, command to finish it) measured over `grid`; one verdict each.

    `reverse_kv` replays every table with its KV budgets reversed (`reversed_kv`); `passes`
    pools only those of the complete passes (default: every complete one)."""
    started = time.monotonic()
    for name, path, finish in tables:
        if not path.is_file():
            why = f"table incomplete: not measured; measure with: {finish}"
            print(f"landscape {name}: no table at {path}\n  goal {name}: NOT met ({why})")
            continue
        # Only complete passes are pooled: a pass measured in part, at another time and
        # load, would favour the cells it reached. Only the grid's cells are replayed.
        # A pass the header sets aside (measured under another load) is not pooled either.
        counts = pass_cells(path, grid)
        excluded = excluded_passes(path)
        if passes is not None:
            excluded |= {n: "not asked for" for n in counts if n not in passes}
        complete = {n for n, c in counts.items() if c == len(grid) and n not in excluded}
        passes_note = ", ".join(
            f"pass {n}: {cells} of {len(grid)} cells"
            + ("" if n in complete else f", not used ({excluded.get(n, 'incomplete')})")
            for n, cells in sorted(counts.items())
        )
        if passes is not None and not complete:
            print(f"landscape {name}: {passes_note}")
            print(f"  goal {name}: NOT met (no complete pass among those asked for)")
            continue
        loaded = load_table(path, complete or None)
        table = {key: cell for key, cell in loaded.items() if key in grid}
        if reverse_kv:
            table, name = reversed_kv(table), f"{name}-reversed-kv"
        missing = missing_cells(table, grid)
        if missing or not any(c.feasible for c in table.values()):
            why = (
                f"table incomplete: {len(missing)} cell(s) not measured; finish with: {finish}"
                if missing
                else "no feasible cell"
            )
            print(f"landscape {name}: {len(table)} cells\n  goal {name}: NOT met ({why})")
            continue
        lines = report(replay(name, table, seeds), measured_seconds(path, complete))
        lines.insert(1, f"  windows per cell pooled over the complete passes ({passes_note})")
        for line in lines:
            print(line, flush=True)
    print(f"replayed {seeds} seeds per strategy in {time.monotonic() - started:.0f} s")
    return 0
