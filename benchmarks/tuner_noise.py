"""A measured table as the replay sees it: each cell's windows, to draw from, and its truth.

A replayed trial does not read a cell's pooled median: it draws one of the cell's measured
windows (`goodput_windows`, every pass that is pooled), seeded, so that a strategy sees the
noise a real trial sees. The truth a recommendation is judged by stays the pooled cell (the
median of its windows, feasible when most were).

Which windows were feasible: a row written since the `windows_feasible_each` column exists
says so window by window ("1;0;1"). The committed tables predate it and keep only the count
(`windows_feasible`, "2/3"): a drawn window of such a row is feasible with that ratio,
drawn independently of its goodput (the count is all the table knows; a feasible window is
not assumed to be the faster one). A table without `goodput_windows` (one measured
elsewhere) has one window a cell: its median row, so its replay carries no noise.

A table with a `capacity_rps` column (the measure's capacity mode) is scored by capacity at
the SLO instead of goodput (`score_kind`): a cell's score, what every strategy maximises and
the memory pricing compares (`Cell.score`, `Window.score`, `Drawn.score`), is then its
capacity in requests per second; a row is one ladder (one pass), the window a trial draws; a
cell is feasible when most of its ladders held some rate.
"""

from __future__ import annotations

import csv
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tuner_replay import CAPACITY, GOODPUT, Cell, ScoreKind, Table, load_table

from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult

REQUIRED_COLUMNS = (
    "kv_cache_memory_bytes",
    "max_num_seqs",
    "goodput_tokens_per_s",
    "feasible",
    "reason",
)

CAPACITY_COLUMN = "capacity_rps"

Key = tuple[int, int]  # (kv_cache_memory_bytes, max_num_seqs)


class TableError(ValueError):
    """A table the replay cannot read: named, with what is wrong, for a one-line message."""


@dataclass(frozen=True, slots=True)
class Window:
    """One measured window: its score (the table's `ScoreKind`), and the chance it was
    feasible (1 or 0 if known)."""

    score: float | None
    feasible_ratio: float


@dataclass(frozen=True, slots=True)
class NoisyCell:
    """A cell's truth (the pooled cell) and the windows a trial draws from."""

    truth: Cell
    windows: tuple[Window, ...]


NoisyTable = dict[Key, NoisyCell]


@dataclass(frozen=True, slots=True)
class Drawn:
    """One trial's drawn window as the replay judges it: its outcome and score."""

    outcome: TrialOutcome
    score: float | None
    memory_bytes: int
    reason: str | None

    @property
    def feasible(self) -> bool:
        return self.outcome is TrialOutcome.FEASIBLE

    def as_trial_result(self) -> TrialResult:
        """What a suggester is told. The tuner's TrialResult has one objective field,
        `goodput_tokens_per_s` (goodput, in the product); the replay hands it the score,
        whichever the table's is, since a suggester maximises what it is told."""
        return TrialResult(self.outcome, self.score, self.memory_bytes, self.reason)


def rows_of(path: Path) -> list[dict[str, str]]:
    """The table's rows; a TableError names a file that is missing or lacks a column."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TableError(f"{path}: cannot read the table ({exc})") from exc
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    reader = csv.DictReader(lines)
    missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise TableError(f"{path}: not a landscape table: no column {', '.join(missing)}")
    rows = list(reader)
    for number, row in enumerate(rows, 1):
        try:
            int(row["kv_cache_memory_bytes"]), int(row["max_num_seqs"]), int(row.get("pass") or 1)
            float(row["goodput_tokens_per_s"] or 0.0)
            [float(g) for g in (row.get("goodput_windows") or "").split(";") if g]
            float(row.get(CAPACITY_COLUMN) or 0.0)
        except (TypeError, ValueError) as exc:
            raise TableError(f"{path}: row {number}: {exc}") from exc
    return rows


def _windows(row: Mapping[str, str]) -> tuple[Window, ...]:
    raw = [g for g in (row.get("goodput_windows") or "").split(";") if g]
    if not raw:
        goodput = float(row["goodput_tokens_per_s"]) if row["goodput_tokens_per_s"] else None
        return (Window(goodput, 1.0 if row["feasible"] == "1" else 0.0),)
    goodputs = [float(g) for g in raw]
    each = [f for f in (row.get("windows_feasible_each") or "").split(";") if f]
    if len(each) == len(goodputs):
        return tuple(Window(g, float(f == "1")) for g, f in zip(goodputs, each, strict=True))
    count = row.get("windows_feasible") or ""
    if "/" in count:
        feasible, total = (int(x) for x in count.split("/"))
        ratio = feasible / total if total else 0.0
    else:
        ratio = 1.0 if row["feasible"] == "1" else 0.0
    return tuple(Window(g, ratio) for g in goodputs)


def score_kind(path: Path) -> ScoreKind:
    """The table's score: capacity at the SLO where it has `capacity_rps`, else goodput."""
    lines = (line for line in path.read_text().splitlines() if not line.startswith("#"))
    return CAPACITY if CAPACITY_COLUMN in next(csv.reader(lines), []) else GOODPUT


def _capacity_cell(rows: Sequence[Mapping[str, str]]) -> NoisyCell:
    """One cell of a capacity table: a window per ladder, the truth their median."""
    capacities = [float(r[CAPACITY_COLUMN]) if r[CAPACITY_COLUMN] else None for r in rows]
    held = [c for c in capacities if c is not None]
    feasible = 2 * len(held) > len(capacities)
    reason = "" if feasible else next((r["reason"] for r in rows if r["reason"]), "no rate held")
    truth = Cell(statistics.median(held) if held else None, feasible, reason)
    return NoisyCell(truth, tuple(Window(c, float(c is not None)) for c in capacities))


def load_noisy(path: Path, passes: set[int] | None = None) -> NoisyTable:
    """Every cell's pooled truth (`load_table`) and its windows from the same passes; a
    table with `capacity_rps` by capacity (see the module docstring)."""
    rows = rows_of(path)
    if score_kind(path) == CAPACITY:
        cells: dict[Key, list[dict[str, str]]] = {}
        for row in rows:
            if passes is None or int(row.get("pass") or 1) in passes:
                key = (int(row["kv_cache_memory_bytes"]), int(row["max_num_seqs"]))
                cells.setdefault(key, []).append(row)
        return {key: _capacity_cell(group) for key, group in cells.items()}
    truth: Table = load_table(path, passes)
    windows: dict[Key, list[Window]] = {}
    for row in rows:
        if passes is not None and int(row.get("pass") or 1) not in passes:
            continue
        key = (int(row["kv_cache_memory_bytes"]), int(row["max_num_seqs"]))
        windows.setdefault(key, []).extend(_windows(row))
    return {key: NoisyCell(cell, tuple(windows[key])) for key, cell in truth.items()}


def mirrored(table: NoisyTable) -> NoisyTable:
    """The same cells with the KV budgets in reverse order (see `tuner_replay.reversed_kv`)."""
    kv = sorted({k for k, _ in table})
    mirror = dict(zip(kv, reversed(kv), strict=True))
    return {(mirror[k], s): cell for (k, s), cell in table.items()}


def draw(cell: NoisyCell, seed: int, key: Key, visit: int) -> Drawn:
    """The `visit`-th trial of this cell in the run seeded `seed`: one window, drawn.

    The draw depends on (seed, cell, visit) only, so every strategy of one seed meets the
    same window on its first visit to a cell (common random numbers: their differences are
    not the draws')."""
    rng = random.Random(f"{seed}:{key[0]}:{key[1]}:{visit}")
    window = cell.windows[rng.randrange(len(cell.windows))]
    feasible = rng.random() < window.feasible_ratio
    if feasible:
        return Drawn(TrialOutcome.FEASIBLE, window.score, key[0], None)
    reason = cell.truth.reason or "this window broke the SLO (the cell was feasible)"
    if reason.startswith("failed to start"):
        return Drawn(TrialOutcome.FAILED_TO_START, None, key[0], reason)
    outcome = TrialOutcome.PREEMPTED if "preemptions" in reason else TrialOutcome.SLO_BROKEN
    return Drawn(outcome, window.score, key[0], reason)


def levels(table: Mapping[Key, object]) -> tuple[list[int], list[int]]:
    """The table's KV budgets and max_num_seqs values, ascending."""
    return sorted({k for k, _ in table}), sorted({s for _, s in table})


def full_grid(table: Mapping[Key, object]) -> Sequence[Key]:
    """Every (KV, seqs) of the table's levels crossed: the grid a table given by path spans."""
    kv, seqs = levels(table)
    return [(k, s) for s in seqs for k in kv]
