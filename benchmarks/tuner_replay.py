"""Read the measured tables: cells pooled over the passes a table's header lets through.

A table is the CSV under `benchmarks/data/landscape_*.csv` (or one given by path, measured
elsewhere): one row per cell and pass, comment lines (`#`) holding how it was made. A cell
measured in several passes pools their windows. What the replay does with the cells is
`tuner_noise` (the windows a trial draws), `tuner_strategies` and `tuner_regret`.
"""

from __future__ import annotations

import csv
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.tuner.problem.space import Knob, KnobKind, SearchSpace


@dataclass(frozen=True, slots=True)
class ScoreKind:
    """What a table's cells are scored by: the figure every strategy maximises and the
    memory pricing compares, with its unit and how the report prints it."""

    name: str
    unit: str
    number_format: str

    def text(self, score: float) -> str:
        """A score with its unit, as the report prints it."""
        return f"{score:{self.number_format}} {self.unit}"


GOODPUT = ScoreKind("goodput", "tok/s", ".0f")
CAPACITY = ScoreKind("capacity", "req/s", ".3g")  # at the SLO


@dataclass(frozen=True, slots=True)
class Cell:
    """One measured grid cell: its score (the table's `ScoreKind`: goodput, or capacity at
    the SLO), whether it met the SLO, and why not."""

    score: float | None
    feasible: bool
    reason: str


Table = dict[tuple[int, int], Cell]


def load_table(path: Path, passes: set[int] | None = None) -> Table:
    """(kv_cache_memory_bytes, max_num_seqs) -> cell scored by goodput, from the CSV (comment
    lines skipped).

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
    # A row without its windows (a table measured elsewhere) counts as one window.
    windows = [
        float(g)
        for r in rows
        for g in (r.get("goodput_windows") or r["goodput_tokens_per_s"] or "0").split(";")
        if g
    ]
    counts = [
        (r.get("windows_feasible") or ("1/1" if r["feasible"] == "1" else "0/1")).split("/")
        for r in rows
    ]
    feasible = 2 * sum(int(n) for n, _ in counts) > sum(int(d) for _, d in counts)
    reason = "" if feasible else next((r["reason"] for r in rows if r["reason"]), "infeasible")
    return Cell(statistics.median(windows), feasible, reason)


def reversed_kv(table: Table) -> Table:
    """The table with its KV budgets in reverse order: the score falling as memory grows.

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
