"""Measure the landscapes on the real CPU vLLM, one server start per cell, resumable.

Each cell starts one server (pinned to `server_cpus`, its OpenMP threads bound there with
VLLM_CPU_OMP_THREADS_BIND, which the CPU build honours), warms it, and measures every
landscape that still lacks this cell: `repeats` windows each, the load generator pinned to
the other core. The cell's row is appended to each landscape's table as soon as it is
measured, so a killed run loses at most the cell in flight and a rerun skips what is there.
One server start serves all landscapes of a cell: a start costs more than the windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tuner_landscapes import BYTES_PER_BLOCK, Landscape, append_row, cell_row, measured_cells

from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.collectors.vllm_metrics import VllmMetricsSource, VllmScrape
from kvpilot.rig.server import ServerSpec, ServerStartError, VllmServer, free_port
from kvpilot.tuner.load.generator import LengthDist, Workload, run_load, run_planned
from kvpilot.tuner.problem.objective import Measurement, TrialResult, evaluate

MAX_NUM_BATCHED_TOKENS = 2048
WARM = Workload(
    num_requests=4,
    prompt_len=LengthDist.fixed(32),
    output_len=LengthDist.fixed(8),
    concurrency=2,
    seed=1,
)


@dataclass(frozen=True, slots=True)
class Pinning:
    """The server's cores and the load generator's (empty: no pinning)."""

    server_cpus: tuple[int, ...] = (0,)
    loadgen_cpus: tuple[int, ...] = (1,)


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


def _hit_ratio(scrapes: Sequence[VllmScrape]) -> float | None:
    """Prefix-cache hits over queries across the window, summed over engines."""
    if len(scrapes) < 2:
        return None
    totals = []
    for scrape in (scrapes[0], scrapes[-1]):
        hits = sum(e.prefix_cache_hits_total or 0.0 for e in scrape.engines)
        queries = sum(e.prefix_cache_queries_total or 0.0 for e in scrape.engines)
        totals.append((hits, queries))
    queries = totals[1][1] - totals[0][1]
    return (totals[1][0] - totals[0][0]) / queries if queries > 0 else None


async def measure_window(
    url: str, landscape: Landscape, window: int, kv_bytes: int
) -> tuple[TrialResult, float | None]:
    """One window of the landscape's traffic, judged against its SLO; and the hit ratio."""
    done = asyncio.Event()
    async with ScrapeClient() as client:
        source = VllmMetricsSource(url, client=client)
        scraper = asyncio.create_task(_scrape_until(source, done))
        report = await run_planned(
            url,
            landscape.plan(window),
            concurrency=landscape.workload.concurrency,
            request_timeout_s=landscape.workload.request_timeout_s,
        )
        done.set()
        scrapes = await scraper
        final = await source.scrape()  # the counters lag until the engine steps again
        newer = not scrapes or (
            isinstance(final, VllmScrape) and final.taken_at_s > scrapes[-1].taken_at_s
        )
        if isinstance(final, VllmScrape) and newer:
            scrapes.append(final)
    measurement = Measurement(report=report, scrapes=tuple(scrapes), memory_bytes=kv_bytes)
    return evaluate(measurement, landscape.slo), _hit_ratio(scrapes)


def cell_spec(kv_bytes: int, seqs: int, pinning: Pinning) -> ServerSpec:
    """One cell's server: its knobs, pinned, with the flags every landscape is measured under."""
    bind = ",".join(str(c) for c in pinning.server_cpus)
    return ServerSpec(
        port=free_port(),
        kv_cache_memory_bytes=kv_bytes,
        max_num_seqs=seqs,
        plugin_enabled=False,
        extra_args=(
            "--max-num-batched-tokens",
            str(max(MAX_NUM_BATCHED_TOKENS, seqs)),
            "--enable-prefix-caching",
        ),
        extra_env=(("VLLM_CPU_OMP_THREADS_BIND", bind),) if bind else (),
        cpus=pinning.server_cpus,
    )


@dataclass(frozen=True, slots=True)
class Windows:
    """One landscape's windows in one cell, and the wall time they and the start took."""

    results: tuple[TrialResult, ...]
    hit_ratios: tuple[float | None, ...]
    measure_s: float
    server_start_s: float


def measure_cell(
    kv_bytes: int, seqs: int, landscapes: Sequence[Landscape], repeats: int, pinning: Pinning
) -> dict[str, Windows]:
    """Start one server with these knobs and measure each landscape `repeats` times."""
    server = VllmServer(cell_spec(kv_bytes, seqs, pinning))
    out: dict[str, Windows] = {}
    started = time.monotonic()
    server.start()
    try:
        try:
            server.wait_healthy(timeout_s=300.0)
        except ServerStartError as exc:
            failed = TrialResult.failed_to_start(exc.log_tail, memory_bytes=kv_bytes)
            start_s = time.monotonic() - started
            return {
                ls.name: Windows((failed,) * repeats, (None,) * repeats, 0.0, start_s)
                for ls in landscapes
            }
        asyncio.run(run_load(server.url, WARM))
        start_s = time.monotonic() - started
        for landscape in landscapes:
            began = time.monotonic()
            results: list[TrialResult] = []
            hits: list[float | None] = []
            for window in range(repeats):
                if server.process is not None and server.process.poll() is not None:
                    code = server.process.returncode
                    results.append(TrialResult.crashed(f"exit code {code}", kv_bytes))
                    hits.append(None)
                    continue
                result, hit = asyncio.run(measure_window(server.url, landscape, window, kv_bytes))
                results.append(result)
                hits.append(hit)
            spent = time.monotonic() - began
            out[landscape.name] = Windows(tuple(results), tuple(hits), spent, start_s)
        return out
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)  # the failure reason is in the row


def measure(
    landscapes: Sequence[Landscape],
    kv_blocks: Sequence[int],
    seqs: Sequence[int],
    repeats: int,
    pinning: Pinning,
    command: str,
    pass_: int = 1,
    shuffled: bool = False,
) -> None:
    """Every cell that some landscape lacks in this pass: max_num_seqs outer, KV inner, or in
    an order shuffled by the pass number, so that a drift in the machine's load over the pass
    does not follow the grid's rows and columns."""
    if pinning.loadgen_cpus:
        os.sched_setaffinity(0, pinning.loadgen_cpus)
    cells = [(n_seqs, blocks) for n_seqs in seqs for blocks in kv_blocks]
    if shuffled:
        random.Random(pass_).shuffle(cells)
    for n_seqs, blocks in cells:
        kv_bytes = blocks * BYTES_PER_BLOCK
        key = (kv_bytes, n_seqs)
        todo = [ls for ls in landscapes if key not in measured_cells(ls.table, pass_)]
        if not todo:
            continue
        started = time.monotonic()
        cell = measure_cell(kv_bytes, n_seqs, todo, repeats, pinning)
        for landscape in todo:
            w = cell[landscape.name]
            row = cell_row(
                kv_bytes,
                n_seqs,
                w.results,
                w.hit_ratios,
                (w.measure_s, w.server_start_s),
                pass_,
            )
            header = (
                f"made by: {command}",
                f"landscape: {landscape.name}; prefix {landscape.prefix_len} tokens "
                f"shared by {landscape.prefix_groups} groups",
                f"workload: {landscape.workload}",
                f"slo: {landscape.slo}",
                f"server: --max-num-batched-tokens max({MAX_NUM_BATCHED_TOKENS}, seqs) "
                f"--enable-prefix-caching; pinned {pinning}",
            )
            append_row(landscape.table, header, row)
            print(
                f"{landscape.name} kv={blocks} blocks seqs={n_seqs} pass {pass_}: "
                f"goodput {row['goodput_tokens_per_s']} "
                f"[{row['goodput_windows']}] feasible {row['windows_feasible']} "
                f"{row['reason'][:80]}",
                flush=True,
            )
        spent = time.monotonic() - started
        load = os.getloadavg()[0]
        print(
            f"cell kv={blocks} seqs={n_seqs} pass {pass_}: {spent:.0f} s, load {load:.1f}",
            flush=True,
        )
