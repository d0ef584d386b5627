"""The agent-side reader against the plugin's real exposition, and its failure values."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.fragmentation import TOO_FEW_FREE_BLOCKS
from kvpilot.collectors.kvpool import plugin
from kvpilot.collectors.kvpool.allocator import allocator_stats_from
from kvpilot.collectors.kvpool.client import KvPoolScrape, KvPoolSource
from kvpilot.collectors.kvpool.plugin import PluginState
from kvpilot.collectors.kvpool.server import (
    AllocatorReading,
    KvPoolCollector,
    PartErrors,
    serve,
)
from kvpilot.collectors.limits import ScrapeLimits
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.rig.server import free_port
from tests.faults.misbehaving import Misbehaving, Writer, answer, endless, late

block_pool = pytest.importorskip("vllm.v1.core.block_pool")


class StandIn:
    def __init__(self, num_blocks: int) -> None:
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_rank=0),
            model_config=SimpleNamespace(served_model_name="tiny"),
        )
        self.block_size = 32
        self.running: list = []
        self.kv_cache_manager = SimpleNamespace(
            block_pool=block_pool.BlockPool(num_blocks, True, 32)
        )

    def _preempt_request(self, request, timestamp, drop_stale_output=False):
        return None

    def update_from_output(self, scheduler_output, model_output):
        return {}


KVPOOL_LINE = b'kvpool_blocks_free{engine="0",model_name="m"} 5\n'


def scrape_once(url: str, timeout_s: float = 2.0) -> KvPoolScrape | SourceError:
    async def go():
        async with ScrapeClient() as client:
            source = KvPoolSource(
                url,
                client=client,
                clock=lambda: 11.0,
                wall_clock=lambda: 12.0,
                limits=ScrapeLimits(timeout_s=timeout_s),
            )
            return await source.scrape()

    return asyncio.run(go())


@pytest.fixture
def plugin_port():
    """A freshly patched stand-in scheduler class and the plugin state serving it."""
    cls = type("Scheduler", (StandIn,), dict(StandIn.__dict__))
    current = PluginState(host="127.0.0.1", base_port=free_port())
    plugin.patch_scheduler_class(cls, current)
    yield cls, current
    current.close()


def test_reads_engine_figures_back(plugin_port) -> None:
    cls, current = plugin_port
    scheduler = cls(num_blocks=65)
    pool = scheduler.kv_cache_manager.block_pool
    held = pool.get_new_blocks(20)
    pool.free_blocks(held[::2])
    scheduler._preempt_request("r", 0.0)
    got = scrape_once(f"http://127.0.0.1:{current.base_port}/metrics")
    assert isinstance(got, KvPoolScrape)
    assert (got.taken_at_s, got.wall_time_s) == (11.0, 12.0)
    (engine,) = got.engines
    assert (engine.engine, engine.model_name) == ("0", "tiny")
    assert engine.blocks_total == 64
    assert engine.blocks_free == pool.get_num_free_blocks()
    assert engine.preemptions_total == 1
    assert engine.block_size_tokens == 32
    assert engine.fragmentation is not None and engine.fragmentation.ratio is not None
    assert engine.fragmentation.longest_free_run == engine.longest_free_run_blocks
    assert got.allocators == ()


def test_guarded_engine_has_reason(plugin_port) -> None:
    cls, current = plugin_port
    scheduler = cls(num_blocks=65)
    scheduler.kv_cache_manager.block_pool.get_new_blocks(60)
    got = scrape_once(f"http://127.0.0.1:{current.base_port}/metrics")
    assert isinstance(got, KvPoolScrape)
    frag = got.engines[0].fragmentation
    assert frag is not None and frag.ratio is None and frag.reason == TOO_FEW_FREE_BLOCKS


def test_reads_allocator_figures_back() -> None:
    segments = [
        {
            "device": 0,
            "total_size": 8 << 20,
            "blocks": [
                {"size": 3 << 20, "state": "inactive"},
                {"size": 4 << 20, "state": "active_allocated"},
                {"size": 1 << 20, "state": "inactive"},
            ],
        }
    ]
    stats = allocator_stats_from(
        0, {"reserved_bytes.all.current": 8 << 20}, segments, taken_at_s=0.0, wall_time_s=0.0
    )
    errors = PartErrors()
    errors.record("allocator", RuntimeError("boom"))
    collector = KvPoolCollector(
        engines=list,
        allocators=lambda: [AllocatorReading(rank="3", stats=stats)],
        errors=errors,
        clock=lambda: 0.0,
    )
    server = serve(collector, "127.0.0.1", 0)
    try:
        got = scrape_once(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.close()
    assert isinstance(got, KvPoolScrape)
    (alloc,) = got.allocators
    assert (alloc.device, alloc.rank) == ("0", "3")
    assert alloc.reserved_bytes == 8 << 20 and alloc.free_in_reserved_bytes == 4 << 20
    assert alloc.largest_free_block_bytes == 3 << 20
    assert alloc.fragmentation_ratio == pytest.approx(0.25)
    assert got.plugin_errors == (("allocator", 1),)
    assert got.engines == ()


def test_refused() -> None:
    got = scrape_once(f"http://127.0.0.1:{free_port()}/metrics")
    assert isinstance(got, SourceError) and got.kind == "refused"


@pytest.mark.parametrize(
    ("writer", "kind"),
    [
        (endless(4, b"busy", status=503), "http_status"),
        (answer(b"<html>hello</html>", "text/html"), "parse_error"),
        (answer(b"other_metric 1\n"), "not_metrics"),
    ],
)
def test_bad_answers_become_values(writer: Writer, kind: str) -> None:
    with Misbehaving({"/metrics": writer}) as server:
        got = scrape_once(f"{server.url}/metrics")
    assert isinstance(got, SourceError) and got.kind == kind and got.source == "kvpool"


def test_timeout_becomes_a_value() -> None:
    with Misbehaving({"/metrics": late(30.0, KVPOOL_LINE)}) as server:
        got = scrape_once(f"{server.url}/metrics", timeout_s=0.3)
    assert isinstance(got, SourceError) and got.kind == "timeout"
