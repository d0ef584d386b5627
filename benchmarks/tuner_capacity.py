"""The measure's capacity mode: each cell's capacity at each landscape's SLO, on the CPU vLLM.

`tuner_efficiency.py --measure --capacity`. One server start per cell, as the goodput mode
(`tuner_measure`), then for every landscape the ladder of `kvpilot.tuner.measure.capacity`:
open-loop Poisson windows of `window_s` at rates 1.5x apart from `start_rps`, refined by two
geometric bisections; a rate holds when at least 95 % of its requests meet the landscape's
SLO and none fails. A window's requests carry the landscape's lengths (and prefixes).

Each landscape's table is `landscape_<name>-capacity.csv` in `out_dir`: the committed
columns (goodput is the window's at the capacity; feasible when some rate held; the reason
of a cell that held none) and three more, `capacity_rps`, `capacity_ladder` (each window:
rate, + held or - not, requests in the SLO of all) and `capacity_failed_at_rps` (empty
beside a capacity when the ladder's top held: the capacity is then a floor). The
replay scores a table with `capacity_rps` by capacity (`tuner_noise`). Every window's
per-request records (TTFT, mean inter-token gap, error) are appended to the table's
`.requests.jsonl` beside it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from capacity import request_records
from tuner_landscapes import BYTES_PER_BLOCK, COLUMNS, Landscape, append_row, measured_cells
from tuner_measure import MAX_NUM_BATCHED_TOKENS, WARM, Pinning, cell_spec

from kvpilot.rig.server import ServerStartError, VllmServer
from kvpilot.tuner.load.generator import LoadReport, run_load, run_planned
from kvpilot.tuner.measure.capacity import Capacity, capacity_at_slo
from kvpilot.tuner.problem.objective import Measurement, TrialResult, evaluate

CAPACITY_COLUMNS = (*COLUMNS, "capacity_rps", "capacity_ladder", "capacity_failed_at_rps")
MIN_WINDOW_REQUESTS = 8  # fewer and 95 % of a window is all of it


@dataclass(frozen=True, slots=True)
class LadderSettings:
    """How each cell's ladder runs: the window's length, the first rate, the most steps."""

    window_s: float = 30.0
    start_rps: float = 2.0
    max_ladder: int = 8  # 1.5 ** 8 = 26x up or down from the start

    def __post_init__(self) -> None:
        if not self.window_s > 0 or not self.start_rps > 0 or self.max_ladder < 1:
            raise ValueError("a ladder needs a positive window, a positive start and a step")


def capacity_table(landscape: Landscape, out_dir: Path) -> Path:
    """Where the landscape's capacity table lives."""
    return out_dir / f"landscape_{landscape.name}-capacity.csv"


def requests_file(table: Path) -> Path:
    """The per-request records of a table's windows, beside it."""
    return table.with_suffix(".requests.jsonl")


def at(landscape: Landscape, rate_rps: float, window_s: float) -> Landscape:
    """The landscape's requests at `rate_rps`, open loop, for about `window_s` seconds."""
    count = max(MIN_WINDOW_REQUESTS, round(rate_rps * window_s))
    workload = replace(landscape.workload, concurrency=None, rate_rps=rate_rps, num_requests=count)
    return replace(landscape, workload=workload)


async def ladder(
    url: str, landscape: Landscape, settings: LadderSettings, records: Path, label: str
) -> tuple[Capacity, dict[float, LoadReport]]:
    """The landscape's capacity on the server at `url`, and each rate's window."""
    reports: dict[float, LoadReport] = {}
    # A request still waiting a window later broke its TTFT long before: no need to wait on.
    timeout_s = max(30.0, settings.window_s)

    async def measure(rate: float) -> LoadReport:
        shaped = at(landscape, rate, settings.window_s)
        report = await run_planned(
            url, shaped.plan(len(reports)), concurrency=None, request_timeout_s=timeout_s
        )
        reports[rate] = report
        with records.open("a") as handle:
            line = {"cell": label, "rate_rps": rate, "requests": request_records(report)}
            handle.write(json.dumps(line) + "\n")
        return report

    found = await capacity_at_slo(
        measure, landscape.slo, start_rps=settings.start_rps, max_ladder=settings.max_ladder
    )
    return found, reports


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def capacity_row(
    kv_bytes: int,
    seqs: int,
    found: Capacity | TrialResult,
    held: TrialResult | None,
    times_s: tuple[float, float],
    pass_: int,
    window_s: float,
) -> dict[str, str]:
    """One cell's row: its capacity and ladder, or the failed start (a TrialResult)."""
    base = {
        "kv_cache_memory_bytes": str(kv_bytes),
        "max_num_seqs": str(seqs),
        "measure_s": f"{times_s[0]:.1f}",
        "server_start_s": f"{times_s[1]:.1f}",
        "pass": str(pass_),
        "window_s": _fmt(window_s),
    }
    if isinstance(found, TrialResult):  # the server did not start
        return {**base, "goodput_tokens_per_s": "", "feasible": "0", "reason": found.reason or ""}
    lowest = min((w.rate_rps for w in found.windows), default=None)
    reason = "" if found.rate_rps is not None else f"no rate held down to {_fmt(lowest)} req/s"
    return {
        **base,
        "goodput_tokens_per_s": _fmt(held.goodput_tokens_per_s if held else None),
        "feasible": "1" if found.rate_rps is not None else "0",
        "reason": reason,
        "capacity_rps": _fmt(found.rate_rps),
        "capacity_ladder": " ".join(
            f"{w.rate_rps:.3g}{'+' if w.holds else '-'}({w.met}/{w.requests})"
            for w in found.windows
        ),
        "capacity_failed_at_rps": _fmt(found.failed_at_rps),
    }


def describe(row: dict[str, str]) -> str:
    """One cell's capacity as the measure prints it, saying when it is only a floor."""
    capacity = row.get("capacity_rps")
    if not capacity:
        return f"capacity none [{row.get('capacity_ladder', '')}] {row['reason'][:80]}"
    floor = "" if row.get("capacity_failed_at_rps") else " (a floor: the ladder's top held)"
    return f"capacity {capacity} req/s{floor} [{row['capacity_ladder']}]"


def _cell(
    kv_bytes: int,
    seqs: int,
    todo: Sequence[tuple[Landscape, Path]],
    settings: LadderSettings,
    pinning: Pinning,
    pass_: int,
) -> dict[str, dict[str, str]]:
    """One server with these knobs; each landscape's ladder on it, as rows."""
    server = VllmServer(cell_spec(kv_bytes, seqs, pinning))
    started = time.monotonic()
    server.start()
    try:
        try:
            server.wait_healthy(timeout_s=300.0)
        except ServerStartError as exc:
            failed = TrialResult.failed_to_start(exc.log_tail, memory_bytes=kv_bytes)
            times = (0.0, time.monotonic() - started)
            return {
                ls.name: capacity_row(kv_bytes, seqs, failed, None, times, pass_, settings.window_s)
                for ls, _ in todo
            }
        asyncio.run(run_load(server.url, WARM))
        start_s = time.monotonic() - started
        rows = {}
        for landscape, table in todo:
            began = time.monotonic()
            label = f"kv {kv_bytes // BYTES_PER_BLOCK} blocks, {seqs} seqs, pass {pass_}"
            found, reports = asyncio.run(
                ladder(server.url, landscape, settings, requests_file(table), label)
            )
            held = None
            if found.rate_rps is not None:
                measured = Measurement(report=reports[found.rate_rps], memory_bytes=kv_bytes)
                held = evaluate(measured, landscape.slo)
            times = (time.monotonic() - began, start_s)
            rows[landscape.name] = capacity_row(
                kv_bytes, seqs, found, held, times, pass_, settings.window_s
            )
        return rows
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)  # the failure reason is in the row


def measure_capacity(
    landscapes: Sequence[Landscape],
    kv_blocks: Sequence[int],
    seqs: Sequence[int],
    settings: LadderSettings,
    pinning: Pinning,
    command: str,
    out_dir: Path,
    pass_: int = 1,
) -> None:
    """Every cell some landscape's capacity table lacks in this pass, appended as measured."""
    if pinning.loadgen_cpus:
        os.sched_setaffinity(0, pinning.loadgen_cpus)
    for n_seqs in seqs:
        for blocks in kv_blocks:
            kv_bytes = blocks * BYTES_PER_BLOCK
            key = (kv_bytes, n_seqs)
            tables = [(ls, capacity_table(ls, out_dir)) for ls in landscapes]
            todo = [(ls, t) for ls, t in tables if key not in measured_cells(t, pass_)]
            if not todo:
                continue
            rows = _cell(kv_bytes, n_seqs, todo, settings, pinning, pass_)
            for landscape, table in todo:
                header = (
                    f"made by: {command}",
                    f"landscape: {landscape.name}; capacity at its SLO, {settings}",
                    f"workload: {landscape.workload} (open loop at each rate of the ladder)",
                    f"slo: {landscape.slo}",
                    f"server: --max-num-batched-tokens max({MAX_NUM_BATCHED_TOKENS}, seqs) "
                    f"--enable-prefix-caching; pinned {pinning}",
                )
                row = rows[landscape.name]
                append_row(table, header, row, CAPACITY_COLUMNS)
                print(
                    f"{landscape.name} kv={blocks} blocks seqs={n_seqs} pass {pass_}: "
                    f"{describe(row)}",
                    flush=True,
                )
