"""The plugin inside a real CPU vLLM: free blocks, preemptions and fragmentation agree with vLLM."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from kvpilot.collectors.kvpool.client import KvPoolScrape, KvPoolSource
from kvpilot.collectors.limits import ScrapeLimits
from kvpilot.collectors.promtext import parse_samples
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.rig.server import VllmServer
from kvpilot.tuner.load.generator import LengthDist, Workload, run_load

pytestmark = pytest.mark.slow

SETTLE_S = 60.0


def kvpool_url(server: VllmServer) -> str:
    assert server.spec.kvpool_port is not None
    return f"http://127.0.0.1:{server.spec.kvpool_port}/metrics"


async def vllm_figures(client: httpx.AsyncClient, server: VllmServer) -> dict[str, float]:
    """vLLM's own view: free blocks from kv_cache_usage_perc and num_gpu_blocks, preemptions."""
    text = (await client.get(f"{server.url}/metrics")).text
    out: dict[str, float] = {}
    for sample in parse_samples(text, prefixes=("vllm:",)):
        labels = dict(sample.labels)
        if sample.name == "vllm:kv_cache_usage_perc":
            out["usage"] = sample.value
        elif sample.name == "vllm:num_preemptions_total":
            out["preemptions"] = sample.value
        elif sample.name == "vllm:cache_config_info":
            out["num_gpu_blocks"] = float(labels["num_gpu_blocks"])
    # num_gpu_blocks includes the null block; usage is over the usable ones.
    usable = out["num_gpu_blocks"] - 1
    out["free"] = round((1.0 - out["usage"]) * usable)
    out["usable"] = usable
    return out


async def kvpool_scrape(client: httpx.AsyncClient, server: VllmServer) -> KvPoolScrape:
    """The plugin port through the scrape client (`client` reads vLLM's own side)."""
    async with ScrapeClient() as scraper:
        source = KvPoolSource(
            kvpool_url(server), client=scraper, limits=ScrapeLimits(timeout_s=10.0)
        )
        got = await source.scrape()
    assert isinstance(got, KvPoolScrape), got
    assert len(got.engines) == 1
    return got


async def wait_idle(client: httpx.AsyncClient, server: VllmServer) -> KvPoolScrape:
    """Until no request runs and vLLM reports an empty pool (deadline SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        scrape = await kvpool_scrape(client, server)
        theirs = await vllm_figures(client, server)
        engine = scrape.engines[0]
        if engine.requests_running == 0 and theirs["usage"] == 0.0:
            return scrape
        assert time.monotonic() < deadline, (engine, theirs)
        await asyncio.sleep(0.2)


PLUGIN_REUSE_S = 1.05  # a scrape after this gets a pass of its own at the next step


def test_free_blocks_agree_with_vllm_under_load(vllm_server: VllmServer) -> None:
    concurrency = 8
    workload = Workload(
        num_requests=96,  # long enough for a dozen fresh snapshots, a second apart
        concurrency=concurrency,
        prompt_len=LengthDist.uniform(40, 90),
        output_len=LengthDist.uniform(60, 200),
        seed=11,
    )

    async def go():
        async with httpx.AsyncClient(timeout=30) as client:
            await wait_idle(client, vllm_server)
            load = asyncio.create_task(run_load(vllm_server.url, workload))
            pairs = []
            while not load.done():
                # vLLM, the plugin, vLLM again: the plugin's step sits between the two.
                before = await vllm_figures(client, vllm_server)
                ours = (await kvpool_scrape(client, vllm_server)).engines[0]
                after = await vllm_figures(client, vllm_server)
                # A snapshot taken for this scrape, not one served again from an earlier one
                # (the plugin reuses a snapshot younger than a second).
                fresh = ours.snapshot_age_s is not None and ours.snapshot_age_s < 0.2
                if ours.requests_running and fresh:
                    pairs.append((before, ours, after))
                await asyncio.sleep(PLUGIN_REUSE_S)
            report = await load
            return report, pairs, await wait_idle(client, vllm_server)

    report, pairs, idle = asyncio.run(go())
    # The load is the means here, not the subject. One request lost to a connection reset
    # (seen once in CI with both cores busy: "ReadError", no byte of the response, the server
    # serving on) does not change what the blocks say, and vLLM frees an aborted request's
    # blocks, which wait_idle checks below. Any other failure, or a second one, fails the test.
    lost = [
        r
        for r in report.failed
        if r.first_token_s is None and (r.error or "").startswith("ReadError")
    ]
    assert len(lost) == len(report.failed) <= 1, report.failed
    assert len(pairs) >= 5, f"too few readings under load: {len(pairs)}"
    # One step of this load moves at most: a block per running request, the prompt blocks
    # of newly admitted requests, and the blocks of requests that finished.
    max_request_blocks = -(-(90 + 200) // 32)
    one_step = concurrency * max_request_blocks
    gaps = []
    for before, ours, after in pairs:
        assert ours.blocks_total == before["usable"]
        low, high = sorted((before["free"], after["free"]))
        assert low - one_step <= ours.blocks_free <= high + one_step, (before, ours, after)
        gaps.append(
            0
            if low <= ours.blocks_free <= high
            else min(abs(ours.blocks_free - low), abs(ours.blocks_free - high))
        )
    # Most readings fall between vLLM's two readings: the same step, not merely close.
    assert statistics.median(gaps) <= 1, gaps
    # At rest the two agree exactly, prefix-cached blocks counted as free by both.
    engine = idle.engines[0]
    assert engine.blocks_free == engine.blocks_total
    assert engine.blocks_free_cached is not None and engine.blocks_free_cached > 0


def test_preemptions_match_vllm_counter(preempting_vllm_server: VllmServer) -> None:
    server = preempting_vllm_server
    workload = Workload(
        num_requests=64,
        concurrency=64,
        prompt_len=LengthDist.uniform(100, 200),
        output_len=LengthDist.fixed(64),
        seed=5,
    )

    async def go():
        async with httpx.AsyncClient(timeout=30) as client:
            start = await kvpool_scrape(client, server)
            base_ours = start.engines[0].preemptions_total
            base_theirs = (await vllm_figures(client, server))["preemptions"]
            started_wall = time.time()
            report = await run_load(server.url, workload)
            deadline = time.monotonic() + SETTLE_S
            while True:
                ours = (await kvpool_scrape(client, server)).engines[0]
                theirs = await vllm_figures(client, server)
                ours_delta = ours.preemptions_total - base_ours
                theirs_delta = theirs["preemptions"] - base_theirs
                if ours_delta == theirs_delta or time.monotonic() > deadline:
                    return report, started_wall, ours, ours_delta, theirs_delta
                await asyncio.sleep(0.5)

    report, started_wall, ours, ours_delta, theirs_delta = asyncio.run(go())
    assert not report.failed
    assert ours_delta > 0, "the load did not preempt; the test proves nothing"
    assert ours_delta == theirs_delta
    assert ours.last_preemption_wall_s is not None
    assert started_wall <= ours.last_preemption_wall_s <= time.time()


def test_fragmentation_zero_at_rest_and_positive_under_load(vllm_server: VllmServer) -> None:
    workload = Workload(
        num_requests=40,
        concurrency=10,
        prompt_len=LengthDist.uniform(30, 120),
        output_len=LengthDist.uniform(20, 240),
        seed=23,
    )

    async def go():
        async with httpx.AsyncClient(timeout=30) as client:
            rest_before = await wait_idle(client, vllm_server)
            load = asyncio.create_task(run_load(vllm_server.url, workload))
            ratios = []
            while not load.done():
                engine = (await kvpool_scrape(client, vllm_server)).engines[0]
                if engine.fragmentation is not None and engine.fragmentation.ratio is not None:
                    ratios.append(engine.fragmentation.ratio)
                await asyncio.sleep(0.2)
            report = await load
            return rest_before, ratios, report, await wait_idle(client, vllm_server)

    rest_before, ratios, report, rest_after = asyncio.run(go())
    assert not report.failed
    for rest in (rest_before, rest_after):
        frag = rest.engines[0].fragmentation
        assert frag is not None and frag.ratio == 0.0
    assert ratios, "no unguarded readings under load"
    assert max(ratios) > 0.0, ratios


def test_memory_ledger_adds_up_to_the_engine_pss(vllm_server: VllmServer) -> None:
    """The CPU ledger's parts (unattributed included) add up to the PSS, read from outside, of
    the engine's worker process (on CPU vLLM always runs the model in a worker process of its
    own, which holds the weights and the KV cache), and its KV part is exactly blocks x block
    bytes."""
    from kvpilot.collectors.kvpool.listen_address import ALLOCATOR_PORT_OFFSET
    from kvpilot.collectors.procfs import descendants, list_processes, read_pss_bytes
    from tests.conftest import KV_BYTES_PER_BLOCK

    assert vllm_server.spec.kvpool_port is not None
    procs = list_processes()
    workers = [
        info
        for info in descendants(vllm_server.pid, procs)
        if info.argv[:1] and info.argv[0].startswith("VLLM::Worker")
    ]
    assert len(workers) == 1, [info.argv for info in descendants(vllm_server.pid, procs)]
    worker_port = vllm_server.spec.kvpool_port + ALLOCATOR_PORT_OFFSET  # local rank 0
    with httpx.Client(timeout=10.0) as client:
        ours = client.get(f"http://127.0.0.1:{worker_port}/metrics").text
        pss = read_pss_bytes(workers[0].pid)
        theirs = client.get(f"{vllm_server.url}/metrics").text
    parts = {
        dict(s.labels)["part"]: s.value
        for s in parse_samples(ours, prefixes=("kvpool_memory_part_bytes",))
    }
    used = [s for s in parse_samples(ours, prefixes=("kvpool_memory_used_bytes",))]
    assert len(used) == 1, ours[-3000:]
    (config,) = [s for s in parse_samples(theirs, prefixes=("vllm:cache_config_info",))]
    num_blocks = int(dict(config.labels)["num_gpu_blocks"])  # the null block included
    assert parts["kv_cache"] == num_blocks * KV_BYTES_PER_BLOCK
    (block,) = parse_samples(ours, prefixes=("kvpool_memory_kv_block_bytes",))
    assert block.value == KV_BYTES_PER_BLOCK
    # Two layers of a 256-hidden llama plus embeddings: well above a megabyte of bf16.
    assert parts["weights"] > 1024 * 1024
    assert sum(parts.values()) == used[0].value
    assert dict(used[0].labels)["source"] == "proc_smaps_rollup_pss"
    assert pss is not None
    assert abs(sum(parts.values()) - pss) <= 0.05 * pss, (parts, pss)
    # The agent reads the same ledger through the engine's port, which publishes the worker's.

    async def through_the_engine_port() -> KvPoolScrape:
        async with httpx.AsyncClient() as unused:
            return await kvpool_scrape(unused, vllm_server)

    got = asyncio.run(through_the_engine_port())
    assert got.worker_errors == ()
    (ledger,) = got.ledgers
    assert (ledger.device, ledger.rank) == ("cpu", "0")
    assert ledger.part("kv_cache") == parts["kv_cache"]
