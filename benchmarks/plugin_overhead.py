"""What the kvpool plugin costs vLLM.

Two parts:

* `micro`: the engine-side costs in isolation: one block-pool pass over a real vLLM
  BlockPool of 200k blocks (contiguous and scattered), and the per-step hook when nobody
  scrapes (a flag check).
* `load`: the same load against the CPU vLLM without and with the plugin (vLLM's
  `VLLM_PLUGINS` allow-list keeps it out), alternating A, B, A, B to cancel drift, scraping
  the plugin at 1 Hz during its runs; prints inter-token latency p50 and p99 and the ratios.

    .venv/bin/python benchmarks/plugin_overhead.py micro
    .venv/bin/python benchmarks/plugin_overhead.py load --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Callable

import httpx

from kvpilot.collectors.kvpool.blocks import count_blocks
from kvpilot.collectors.kvpool.plugin import EngineHandle
from kvpilot.collectors.kvpool.server import PartErrors
from kvpilot.rig.server import ServerSpec, VllmServer, free_kvpool_port, free_port
from kvpilot.tuner.load.generator import LengthDist, Workload, percentile, run_load


def _per_call_s(fn: Callable[[], object], repeat: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def micro(num_blocks: int) -> None:
    """Time one pool pass and the idle per-step hook."""
    from vllm.v1.core.block_pool import BlockPool

    for label, keep in (("all free", None), ("scattered 50 %", 0.5), ("scattered 90 %", 0.9)):
        pool = BlockPool(num_blocks, True, 16)
        if keep is not None:
            rng = random.Random(1)
            blocks = pool.get_new_blocks(pool.get_num_free_blocks())
            pool.free_blocks([b for b in blocks if rng.random() < keep])
        per_pass = _per_call_s(lambda pool=pool: count_blocks(pool), repeat=10)
        print(f"pool pass, {num_blocks} blocks, {label}: {per_pass * 1e3:.2f} ms")

    handle = EngineHandle(
        object.__new__(type("S", (), {})),
        engine="0",
        model_name="bench",
        errors=PartErrors(),
        clock=time.monotonic,
        wall_clock=time.time,
    )
    per_step = _per_call_s(handle.on_step_end, repeat=200_000)
    print(f"per-step hook with nobody scraping: {per_step * 1e9:.0f} ns")


async def _scrape_every_second(url: str, stop: asyncio.Event) -> int:
    scrapes = 0
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                await client.get(url)
                scrapes += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
    return scrapes


async def _one_run(
    server: VllmServer, workload: Workload, scrape: bool
) -> tuple[list[float], float, int]:
    warmup = Workload(
        num_requests=4,
        concurrency=4,
        prompt_len=LengthDist.fixed(32),
        output_len=LengthDist.fixed(8),
    )
    await run_load(server.url, warmup)
    stop = asyncio.Event()
    scraper = None
    if scrape and server.spec.kvpool_port is not None:
        url = f"http://127.0.0.1:{server.spec.kvpool_port}/metrics"
        scraper = asyncio.create_task(_scrape_every_second(url, stop))
    report = await run_load(server.url, workload)
    stop.set()
    scrapes = await scraper if scraper is not None else 0
    if report.failed:
        raise RuntimeError(f"{len(report.failed)} requests failed: {report.failed[0].error}")
    return report.inter_tokens_s(), report.output_tokens_per_s(), scrapes


def load(rounds: int, workload: Workload, extra_args: tuple[str, ...]) -> None:
    """Alternate runs without (A) and with (B) the plugin; print ITL p50/p99 ratios."""
    itl: dict[bool, list[float]] = {False: [], True: []}
    throughput: dict[bool, list[float]] = {False: [], True: []}
    for round_index in range(rounds):
        for with_plugin in (False, True):
            spec = ServerSpec(
                port=free_port(),
                kvpool_port=free_kvpool_port() if with_plugin else None,
                plugin_enabled=with_plugin,
                extra_args=extra_args,
            )
            with VllmServer(spec) as server:
                gaps, tokens_per_s, scrapes = asyncio.run(
                    _one_run(server, workload, scrape=with_plugin)
                )
            itl[with_plugin].extend(gaps)
            throughput[with_plugin].append(tokens_per_s)
            name = "B with plugin" if with_plugin else "A without"
            print(
                f"round {round_index + 1} {name}: ITL p50 {percentile(gaps, 0.5) * 1e3:.2f} ms,"
                f" p99 {percentile(gaps, 0.99) * 1e3:.2f} ms, {tokens_per_s:.1f} output tok/s,"
                f" {len(gaps)} gaps, {scrapes} scrapes"
            )
    for q in (0.5, 0.99):
        base, plugged = percentile(itl[False], q), percentile(itl[True], q)
        print(
            f"ITL p{int(q * 100)}: without {base * 1e3:.2f} ms, with {plugged * 1e3:.2f} ms,"
            f" ratio {plugged / base:.3f}"
        )
    print(f"mean ITL ratio {statistics.fmean(itl[True]) / statistics.fmean(itl[False]):.3f}")
    with_tps, without_tps = statistics.fmean(throughput[True]), statistics.fmean(throughput[False])
    print(f"output tokens/s ratio {with_tps / without_tps:.3f}")
    # Client-side gaps are bursty (streamed chunks coalesce) and a shared machine drifts:
    # trust the ratios only when the A runs agree with each other.


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    m = sub.add_parser("micro")
    m.add_argument("--blocks", type=int, default=200_000)
    ld = sub.add_parser("load")
    ld.add_argument("--rounds", type=int, default=2)
    ld.add_argument("--requests", type=int, default=48)
    ld.add_argument("--concurrency", type=int, default=8)
    ld.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM flag (repeat)")
    args = parser.parse_args()
    if args.part == "micro":
        micro(args.blocks)
        return
    workload = Workload(
        num_requests=args.requests,
        concurrency=args.concurrency,
        prompt_len=LengthDist.uniform(32, 128),
        output_len=LengthDist.uniform(64, 128),
        seed=3,
    )
    load(args.rounds, workload, tuple(args.vllm_arg))


if __name__ == "__main__":
    main()
