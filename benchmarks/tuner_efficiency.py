"""How many trials the Bayesian suggester needs, against random search and a row-major grid.

Two modes:

* `--measure`: offline, on the real CPU vLLM (the rig), start one server per cell of a grid
  of `--kv-cache-memory-bytes` x `--max-num-seqs`, drive the same workload through each,
  and write the table (knobs -> goodput, feasible, reason) as CSV with the command that made
  it in a header comment. Slow: one server start per cell.
* replay (the default): read such a table and run each suggester over it many times. A trial
  is a lookup of the cell the suggester asked for. Prints, per method, the trials needed to
  reach 95 % of the table's best feasible goodput (median and spread over seeds), and a
  one-sided Mann-Whitney U test of Bayesian against each baseline across seeds.

    .venv/bin/python benchmarks/tuner_efficiency.py --measure --out benchmarks/data/tuner_grid.csv
    .venv/bin/python benchmarks/tuner_efficiency.py --table benchmarks/data/tuner_grid.csv
    .venv/bin/python benchmarks/tuner_efficiency.py --quick   # CI: a few seeds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvpilot.collectors.vllm_metrics import VllmMetricsSource, VllmScrape
from kvpilot.rig.server import ServerSpec, ServerStartError, VllmServer, free_port
from kvpilot.tuner.loadgen import LengthDist, Workload, run_load
from kvpilot.tuner.objective import Measurement, Outcome, Slo, TrialResult, evaluate
from kvpilot.tuner.space import Knob, KnobKind, SearchSpace
from kvpilot.tuner.suggest import (
    BayesianSuggester,
    GridSuggester,
    RandomSuggester,
    SearchExhausted,
    Suggester,
)

DEFAULT_TABLE = Path(__file__).resolve().parent / "data" / "tuner_grid.csv"
BYTES_PER_BLOCK = 32 * 1024  # the tiny model: 2 layers x K,V x 32 tokens x 2 heads x 64 x bf16
MEASURE_WORKLOAD = Workload(
    num_requests=48,
    prompt_len=LengthDist.uniform(64, 256),
    output_len=LengthDist.uniform(32, 128),
    concurrency=24,
    seed=11,
)
MEASURE_SLO = Slo(ttft_p95_s=3.0, inter_token_p95_s=0.25, max_preemptions_per_request=0.25)
COLUMNS = (
    "kv_cache_memory_bytes",
    "max_num_seqs",
    "goodput_tokens_per_s",
    "feasible",
    "reason",
    "output_tokens_per_s",
    "ttft_p95_s",
    "inter_token_p95_s",
    "preemptions_per_request",
    "attainment_ratio",
)


# --- measure -----------------------------------------------------------------------------


async def _scrape_until(source: VllmMetricsSource, done: asyncio.Event) -> list[VllmScrape]:
    scrapes: list[VllmScrape] = []
    while True:
        scrape = await source.scrape()
        if isinstance(scrape, VllmScrape):
            scrapes.append(scrape)
        if done.is_set():
            return scrapes
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout=1.0)


async def _measure_window(url: str, workload: Workload) -> Measurement:
    done = asyncio.Event()
    async with httpx.AsyncClient() as client:
        source = VllmMetricsSource(url, client=client)
        scraper = asyncio.create_task(_scrape_until(source, done))
        report = await run_load(url, workload)
        done.set()
        scrapes = await scraper
        final = await source.scrape()  # the counter lags until the victim runs again
        if isinstance(final, VllmScrape) and final.taken_at_s > scrapes[-1].taken_at_s:
            scrapes.append(final)
    return Measurement(report=report, scrapes=tuple(scrapes))


def measure_cell(kv_bytes: int, max_num_seqs: int, workload: Workload, slo: Slo) -> TrialResult:
    """Start one server with these knobs, warm it, measure one window, stop it."""
    spec = ServerSpec(
        port=free_port(),
        kv_cache_memory_bytes=kv_bytes,
        max_num_seqs=max_num_seqs,
        plugin_enabled=False,
        extra_args=("--max-num-batched-tokens", str(max(2048, max_num_seqs))),
    )
    server = VllmServer(spec)
    server.start()
    try:
        try:
            server.wait_healthy(timeout_s=300.0)
        except ServerStartError as exc:
            return TrialResult.failed_to_start(exc.log_tail, memory_bytes=kv_bytes)
        warm = Workload(num_requests=4, prompt_len=LengthDist.fixed(32),
                        output_len=LengthDist.fixed(8), concurrency=2, seed=1)  # fmt: skip
        asyncio.run(run_load(spec.url, warm))
        measurement = asyncio.run(_measure_window(spec.url, workload))
        if server.process is not None and server.process.poll() is not None:
            return TrialResult.crashed(f"exit code {server.process.returncode}", kv_bytes)
        return evaluate(
            Measurement(measurement.report, measurement.scrapes, memory_bytes=kv_bytes), slo
        )
    finally:
        server.stop()


def _row(kv_bytes: int, seqs: int, result: TrialResult) -> dict[str, str]:
    m = result.metrics

    def fmt(value: float | None) -> str:
        return "" if value is None else f"{value:.4g}"

    return {
        "kv_cache_memory_bytes": str(kv_bytes),
        "max_num_seqs": str(seqs),
        "goodput_tokens_per_s": fmt(result.goodput_tokens_per_s),
        "feasible": "1" if result.feasible else "0",
        "reason": result.reason or "",
        "output_tokens_per_s": fmt(m.output_tokens_per_s if m else None),
        "ttft_p95_s": fmt(m.ttft_p95_s if m else None),
        "inter_token_p95_s": fmt(m.inter_token_p95_s if m else None),
        "preemptions_per_request": fmt(m.preemptions_per_request if m else None),
        "attainment_ratio": fmt(m.attainment_ratio if m else None),
    }


def measure(kv_blocks: Sequence[int], seqs: Sequence[int], out: Path, argv: Sequence[str]) -> None:
    """Measure every cell (max_num_seqs outer, KV inner) and write the table as it goes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(shlex.quote(a) for a in ["benchmarks/tuner_efficiency.py", *argv])
    with out.open("w", newline="") as handle:
        handle.write(f"# made by: .venv/bin/python {command}\n")
        handle.write(f"# workload: {MEASURE_WORKLOAD}\n# slo: {MEASURE_SLO}\n")
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        for n_seqs in seqs:
            for blocks in kv_blocks:
                kv_bytes = blocks * BYTES_PER_BLOCK
                started = time.monotonic()
                result = measure_cell(kv_bytes, n_seqs, MEASURE_WORKLOAD, MEASURE_SLO)
                writer.writerow(_row(kv_bytes, n_seqs, result))
                handle.flush()
                print(
                    f"kv={blocks} blocks seqs={n_seqs}: {result.outcome} "
                    f"goodput={result.goodput_tokens_per_s} ({time.monotonic() - started:.0f} s)"
                    f" {result.reason or ''}",
                    flush=True,
                )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure the grid on the CPU vLLM")
    parser.add_argument("--kv-blocks", default="40,80,160,320", help="KV budgets in blocks")
    parser.add_argument("--seqs", default="2,6,16,48", help="max_num_seqs values")
    parser.add_argument("--out", type=Path, default=DEFAULT_TABLE)
    parser.add_argument("--table", type=Path, default=DEFAULT_TABLE)
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="a short replay for CI")
    args = parser.parse_args(args_list)
    if args.measure:
        blocks = [int(x) for x in args.kv_blocks.split(",")]
        seqs = [int(x) for x in args.seqs.split(",")]
        measure(blocks, seqs, args.out, args_list)
        return 0
    return replay_main(args.table, seeds=5 if args.quick else args.seeds)


@dataclass(frozen=True, slots=True)
class Cell:
    """One measured grid cell."""

    goodput_tokens_per_s: float | None
    feasible: bool
    reason: str


def load_table(path: Path) -> dict[tuple[int, int], Cell]:
    """(kv_cache_memory_bytes, max_num_seqs) -> cell, from the CSV (comment lines skipped)."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    table = {}
    for row in csv.DictReader(lines):
        goodput = float(row["goodput_tokens_per_s"]) if row["goodput_tokens_per_s"] else None
        key = (int(row["kv_cache_memory_bytes"]), int(row["max_num_seqs"]))
        table[key] = Cell(goodput, row["feasible"] == "1", row["reason"])
    return table


def table_space(table: dict[tuple[int, int], Cell]) -> SearchSpace:
    """The two knobs restricted to the measured levels (log scale, as the tuner uses them)."""
    kv = sorted({k for k, _ in table})
    seqs = sorted({s for _, s in table})
    return SearchSpace(
        (
            Knob("kv_cache_memory_bytes", KnobKind.INTEGER, kv[0], kv[-1], log_scale=True,
                 levels=tuple(kv)),
            Knob("max_num_seqs", KnobKind.INTEGER, seqs[0], seqs[-1], log_scale=True,
                 levels=tuple(seqs)),
        )
    )  # fmt: skip


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


def trials_to_target(
    suggester: Suggester, table: dict[tuple[int, int], Cell], target: float
) -> int | None:
    """Trials until a feasible cell reaches `target` goodput; None if the search ran out."""
    for trial in range(1, len(table) + 1):
        try:
            candidate = suggester.ask()
        except SearchExhausted:
            return None
        cell = table[(int(candidate["kv_cache_memory_bytes"]), int(candidate["max_num_seqs"]))]
        suggester.tell(candidate, _result(cell))
        if cell.feasible and (cell.goodput_tokens_per_s or 0.0) >= target:
            return trial
    return None


def _summary(name: str, values: Sequence[int]) -> str:
    ordered = sorted(values)
    q1, q3 = ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]
    return (
        f"{name:>9}: median {statistics.median(ordered):5.1f}  IQR {q1}-{q3}  "
        f"range {ordered[0]}-{ordered[-1]}  (n={len(ordered)})"
    )


def replay_main(table_path: Path, seeds: int) -> int:
    """Replay the table with every method; print trials to 95 % of the best and the tests."""
    from scipy.stats import mannwhitneyu, wilcoxon

    table = load_table(table_path)
    space = table_space(table)
    best = max(c.goodput_tokens_per_s or 0.0 for c in table.values() if c.feasible)
    target = 0.95 * best
    print(f"table: {table_path} ({len(table)} cells, {sum(c.feasible for c in table.values())} "
          f"feasible), best goodput {best:.1f} tok/s, target {target:.1f} (95 %)")  # fmt: skip
    grid_needed = trials_to_target(GridSuggester(space), table, target)
    assert grid_needed is not None, "the grid walks every cell"
    runs: dict[str, list[int]] = {"bayesian": [], "random": []}
    started = time.monotonic()
    for seed in range(seeds):
        for name, make in (("bayesian", BayesianSuggester), ("random", RandomSuggester)):
            needed = trials_to_target(make(space, seed=seed), table, target)
            runs[name].append(len(table) if needed is None else needed)
    print(f"replayed {seeds} seeds in {time.monotonic() - started:.0f} s")
    print(_summary("bayesian", runs["bayesian"]))
    print(_summary("random", runs["random"]))
    print(f"{'grid':>9}: {grid_needed} (row-major: max_num_seqs outer, KV budget inner)")
    bayes = runs["bayesian"]
    p_random = mannwhitneyu(bayes, runs["random"], alternative="less").pvalue
    diffs = [b - grid_needed for b in bayes]
    p_grid = (
        wilcoxon(diffs, alternative="less").pvalue if any(diffs) else float("nan")
    )  # all equal: no test
    print(f"Bayesian < random: one-sided Mann-Whitney U p = {p_random:.3g}")
    print(f"Bayesian < grid:   one-sided Wilcoxon signed-rank p = {p_grid:.3g}")
    median = statistics.median(bayes)
    goal = median <= grid_needed / 3 and median < statistics.median(runs["random"])
    print(
        f"goal (median <= grid/3 = {grid_needed / 3:.1f} and < random, p < 0.05): "
        f"{'met' if goal and p_random < 0.05 else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
