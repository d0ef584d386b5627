"""The tuner benchmark's landscapes: what traffic each sends, its SLO, and its table on disk.

A landscape is one workload over the same grid of `--kv-cache-memory-bytes` x
`--max-num-seqs`. Each table row is one cell: the median of several measurement windows,
with their spread kept (`goodput_min`, `goodput_max`, every window's goodput, and how many
windows were feasible).

The machine's load drifts over minutes, so a cell's windows, measured back to back, share
most of it; a later pass (`--pass 2`) measures every cell again at another time, and the
replay pools every pass's windows of a cell.

Prefix reuse (the `prefix` landscape) is built here, not in the load generator: requests
are dealt round-robin into groups, and every request of a group starts with the group's
shared token prefix followed by its own random suffix. The prefixes are drawn from the
window's seed, so each window starts with a cold cache for its groups and reuses within
itself; the server runs with `--enable-prefix-caching`.
"""

from __future__ import annotations

import csv
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvpilot.tuner.load.generator import LengthDist, PlannedRequest, Workload, plan_requests
from kvpilot.tuner.problem.objective import Slo, TrialResult

DATA = Path(__file__).resolve().parent / "data"
BYTES_PER_BLOCK = 32 * 1024  # the tiny model: 2 layers x K,V x 32 tokens x 2 heads x 64 x bf16


@dataclass(frozen=True, slots=True)
class Landscape:
    """One workload and SLO; `prefix_len` > 0 gives every request a group's shared prefix."""

    name: str
    workload: Workload
    slo: Slo
    prefix_len: int = 0
    prefix_groups: int = 1

    @property
    def table(self) -> Path:
        return DATA / f"landscape_{self.name}.csv"

    def plan(self, window: int) -> list[PlannedRequest]:
        """The requests of one window (window 0, 1, ... draw different tokens)."""
        seed = self.workload.seed + 1000 * window
        planned = plan_requests(replace(self.workload, seed=seed))
        if self.prefix_len <= 0:
            return planned
        rng = random.Random(seed + 1)
        vocab = self.workload.vocab_size
        prefixes = [
            tuple(rng.randrange(3, vocab) for _ in range(self.prefix_len))
            for _ in range(self.prefix_groups)
        ]
        return [
            replace(item, prompt=prefixes[item.index % self.prefix_groups] + item.prompt)
            for item in planned
        ]


LANDSCAPES = (
    Landscape(
        "chat",
        Workload(
            num_requests=48,
            prompt_len=LengthDist.uniform(32, 160),
            output_len=LengthDist.uniform(32, 96),
            concurrency=48,
            seed=21,
        ),
        Slo(ttft_p95_s=2.0, inter_token_p95_s=0.25, max_preemptions_per_request=0.25),
    ),
    Landscape(
        "long",
        Workload(
            num_requests=24,
            prompt_len=LengthDist.uniform(512, 768),
            output_len=LengthDist.uniform(16, 48),
            concurrency=24,
            seed=31,
        ),
        Slo(ttft_p95_s=4.0, inter_token_p95_s=0.4, max_preemptions_per_request=0.25),
    ),
    Landscape(
        "prefix",
        # 384 shared tokens + 32..96 own tokens; 4 groups of 12 requests.
        Workload(
            num_requests=48,
            prompt_len=LengthDist.uniform(32, 96),
            output_len=LengthDist.uniform(32, 64),
            concurrency=48,
            seed=41,
        ),
        Slo(ttft_p95_s=2.0, inter_token_p95_s=0.25, max_preemptions_per_request=0.25),
        prefix_len=384,
        prefix_groups=4,
    ),
    Landscape(
        # Measured after the Bayesian suggester's memory prior was chosen, to judge it on a
        # table it was not fitted to: long answers under a tight inter-token SLO; small
        # budgets preempt them, few sequences queue them past the TTFT limit.
        "stream",
        Workload(
            num_requests=48,
            prompt_len=LengthDist.uniform(16, 64),
            output_len=LengthDist.uniform(128, 256),
            concurrency=48,
            seed=51,
        ),
        Slo(ttft_p95_s=3.0, inter_token_p95_s=0.025, max_preemptions_per_request=0.25),
    ),
)


def _tight(name: str, inter_token_p95_s: float) -> Landscape:
    """The burst landscape `name`'s traffic (and TTFT limit) under a tighter inter-token one."""
    (burst,) = [landscape for landscape in LANDSCAPES if landscape.name == name]
    slo = replace(burst.slo, inter_token_p95_s=inter_token_p95_s)
    return replace(burst, name=f"{name}-tight", slo=slo)


# Measured by capacity only (`--measure --capacity`), replayed with `--table`: the traffic
# above under an inter-token limit that binds as `max_num_seqs` grows. On the CPU vLLM each
# request's own p95 gap grows with the running batch (chat at 128 sequences: about 7 ms at
# 15 req/s, 14 ms at 35), while a small `max_num_seqs` queues arrivals past the TTFT limit,
# so the best capacity lies between; memory priced, so does the budget.
CAPACITY_ONLY = (
    _tight("chat", 0.010),
    _tight("stream", 0.015),
    # Long prompts: their prefill chunks stretch the gaps of every running request.
    _tight("long", 0.040),
    _tight("prefix", 0.012),
)
BY_NAME = {landscape.name: landscape for landscape in (*LANDSCAPES, *CAPACITY_ONLY)}


def at_rate(landscape: Landscape, rate_rps: float) -> Landscape:
    """The landscape's requests sent open-loop (Poisson arrivals at `rate_rps`) instead of
    all at once: its own table, `landscape_<name>-<rate>rps.csv`, replayed with `--table`.

    A closed burst measures how fast a cell drains one burst; arrivals at several rates
    measure what it sustains under the SLO, where an inter-token limit can bind as
    `max_num_seqs` grows."""
    if rate_rps <= 0:
        raise ValueError(f"a rate must be positive, not {rate_rps:g}")
    workload = replace(landscape.workload, concurrency=None, rate_rps=rate_rps)
    return replace(landscape, name=f"{landscape.name}-{rate_rps:g}rps", workload=workload)


COLUMNS = (
    "kv_cache_memory_bytes",
    "max_num_seqs",
    "goodput_tokens_per_s",  # the median window's
    "feasible",  # a majority of the windows was feasible
    "reason",
    "windows_feasible",
    "goodput_min",
    "goodput_max",
    "goodput_windows",  # every window's goodput, ';'-separated, in the order measured
    "output_tokens_per_s",
    "ttft_p95_s",
    "inter_token_p95_s",
    "preemptions_per_request",
    "attainment_ratio",
    "prefix_hit_ratio",
    "window_s",  # the median window's length
    "measure_s",  # this landscape's windows in this cell, wall time
    "server_start_s",  # the cell's server start and warm-up, shared by its landscapes
    "pass",  # 1, 2, ...: a later pass measures every cell again, at another time
    "windows_feasible_each",  # each window's feasibility, ';'-separated (tables since it)
)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def cell_row(
    kv_bytes: int,
    seqs: int,
    results: Sequence[TrialResult],
    hit_ratios: Sequence[float | None],
    times_s: tuple[float, float],
    pass_: int = 1,
) -> dict[str, str]:
    """One cell from its windows: median goodput, majority feasibility, the spread kept."""
    goodputs = [r.goodput_tokens_per_s or 0.0 for r in results]
    feasible = sum(r.feasible for r in results)
    majority = feasible * 2 > len(results)
    reasons = [r.reason for r in results if not r.feasible and r.reason]
    metrics = [r.metrics for r in results if r.metrics is not None]
    reason = "" if majority else (reasons[len(reasons) // 2] if reasons else "infeasible")
    return {
        "kv_cache_memory_bytes": str(kv_bytes),
        "max_num_seqs": str(seqs),
        "goodput_tokens_per_s": _fmt(statistics.median(goodputs)),
        "feasible": "1" if majority else "0",
        "reason": reason,
        "windows_feasible": f"{feasible}/{len(results)}",
        "goodput_min": _fmt(min(goodputs)),
        "goodput_max": _fmt(max(goodputs)),
        "goodput_windows": ";".join(_fmt(g) for g in goodputs),
        "output_tokens_per_s": _fmt(_median([m.output_tokens_per_s for m in metrics])),
        "ttft_p95_s": _fmt(_median([m.ttft_p95_s for m in metrics])),
        "inter_token_p95_s": _fmt(_median([m.inter_token_p95_s for m in metrics])),
        "preemptions_per_request": _fmt(_median([m.preemptions_per_request for m in metrics])),
        "attainment_ratio": _fmt(_median([m.attainment_ratio for m in metrics])),
        "prefix_hit_ratio": _fmt(_median(hit_ratios)),
        "window_s": _fmt(_median([m.duration_s for m in metrics])),
        "measure_s": f"{times_s[0]:.1f}",
        "server_start_s": f"{times_s[1]:.1f}",
        "pass": str(pass_),
        "windows_feasible_each": ";".join("1" if r.feasible else "0" for r in results),
    }


def read_rows(path: Path) -> list[dict[str, str]]:
    """The table's rows (comment lines skipped); none when the file does not exist."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    return list(csv.DictReader(lines))


def measured_cells(path: Path, pass_: int = 1) -> set[tuple[int, int]]:
    """(kv_cache_memory_bytes, max_num_seqs) of every cell this pass already put in the table."""
    return {
        (int(r["kv_cache_memory_bytes"]), int(r["max_num_seqs"]))
        for r in read_rows(path)
        if int(r.get("pass") or 1) == pass_
    }


def _header(path: Path) -> Sequence[str]:
    lines = (line for line in path.read_text().splitlines() if not line.startswith("#"))
    return tuple(next(csv.reader(lines), COLUMNS))


def append_row(
    path: Path, header: Sequence[str], row: dict[str, str], columns: Sequence[str] = COLUMNS
) -> None:
    """Append one cell; a new file first gets the header comment lines and the CSV header
    (`columns`: the committed ones, or those plus a mode's own, such as capacity's)."""
    new = not path.is_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    # A table begun before a column was added keeps its header: rows appended to it leave
    # the new column out rather than shift every value after it.
    fields = columns if new else _header(path)
    with path.open("a", newline="") as handle:
        if new:
            handle.writelines(f"# {line}\n" for line in header)
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)
