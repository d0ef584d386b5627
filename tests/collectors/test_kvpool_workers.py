"""The workers' ledgers reach the agent through the engine's port: the engine core publishes
the ports it computed for its workers, and the agent's source follows them within its limits."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from kvpilot.collectors.kvpool import plugin
from kvpilot.collectors.kvpool.client import WORKER_SOURCE, KvPoolScrape, KvPoolSource
from kvpilot.collectors.kvpool.ledger import WEIGHTS
from kvpilot.collectors.kvpool.listen_address import ALLOCATOR_PORT_OFFSET
from kvpilot.collectors.kvpool.plugin import PluginState
from kvpilot.collectors.kvpool.worker_ports import engine_worker_ports, worker_port
from kvpilot.collectors.kvpool.worker_urls import MAX_WORKER_PORTS, with_port, worker_urls
from kvpilot.collectors.limits import ScrapeLimits
from kvpilot.collectors.promtext import MetricSample
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.rig.server import free_port

block_pool = pytest.importorskip("vllm.v1.core.block_pool")


def parallel(*, tp: int, dp_local: int = 0, nodes: int = 1) -> SimpleNamespace:
    """The fields of vLLM's ParallelConfig that place a worker."""
    return SimpleNamespace(
        world_size=tp,
        nnodes_within_dp=nodes,
        data_parallel_rank=dp_local,
        data_parallel_rank_local=dp_local,
    )


def test_each_worker_serves_on_the_port_its_engine_publishes() -> None:
    config = parallel(tp=2, dp_local=1)
    published = engine_worker_ports(9000, config)
    assert published == (
        (0, 9000 + ALLOCATOR_PORT_OFFSET + 2),
        (1, 9000 + ALLOCATOR_PORT_OFFSET + 3),
    )
    assert [worker_port(9000, config, rank) for rank in (0, 1)] == [port for _, port in published]
    # Tensor parallelism over two nodes: the engine's node holds ranks 0 and 1; rank 3 is the
    # second worker of the other node, on that node's second slot.
    two_nodes = parallel(tp=4, nodes=2)
    assert engine_worker_ports(9000, two_nodes) == ((0, 9100), (1, 9101))
    assert worker_port(9000, two_nodes, 3) == 9101


def port_sample(worker: str, value: float) -> MetricSample:
    labels = (("engine", "0"), ("model_name", "tiny"), ("worker", worker))
    return MetricSample("kvpool_worker_port", labels, float(value))


def test_published_ports_become_urls_on_the_engines_own_host_and_bad_ones_are_refused() -> None:
    engine = "http://user:pw@[::1]:9000/metrics"
    samples = [
        port_sample("0", 9100),
        port_sample("1", 9100),  # twice: read once
        port_sample("2", 9000),  # the engine's own port: already read
        port_sample("3", 70000),
        port_sample("4", 9101.5),
        port_sample("5", -1),
    ]
    urls, refused = worker_urls(samples, engine)
    assert urls == ("http://user:pw@[::1]:9100/metrics",)
    assert {(item.field, item.reason) for item in refused} == {
        ("worker_port[3]", "out_of_range"),
        ("worker_port[4]", "not_integer"),
        ("worker_port[5]", "negative"),
    }
    assert with_port("http://10.0.0.7:9000/metrics?x=1", 9105) == "http://10.0.0.7:9105/metrics?x=1"
    many = [port_sample(str(i), 10000 + i) for i in range(MAX_WORKER_PORTS + 5)]
    urls, refused = worker_urls(many, engine)
    assert len(urls) == MAX_WORKER_PORTS and [item.field for item in refused] == ["worker_port"]


class Scheduler:
    """An engine core's scheduler with two tensor-parallel workers (vLLM's mp executor)."""

    def __init__(self) -> None:
        self.vllm_config = SimpleNamespace(
            parallel_config=parallel(tp=2),
            model_config=SimpleNamespace(served_model_name=["tiny"]),
        )
        self.block_size = 16
        self.running: list[object] = []
        self.kv_cache_manager = SimpleNamespace(block_pool=block_pool.BlockPool(33, True, 16))


class Worker:
    """A CPU worker: its rank, parallel config, model and KV tensors."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.device = SimpleNamespace(type="cpu", index=None)
        self.parallel_config = parallel(tp=2)
        kv = [torch.zeros(33 * 1024, dtype=torch.int8)]
        self.model_runner = SimpleNamespace(model=torch.nn.Linear(64, 32), kv_caches=kv)


@pytest.fixture
def engine_state() -> Iterator[PluginState]:
    """The engine core's plugin with one scheduler attached; its workers are not started."""
    cls = type("Scheduler", (Scheduler,), {"__init__": Scheduler.__init__})
    current = PluginState(host="127.0.0.1", base_port=free_port())
    plugin.patch_scheduler_class(cls, current)
    current.scheduler = cls()  # type: ignore[attr-defined]  # kept alive for the weakref
    yield current
    current.close()


def start_worker(engine: PluginState, rank: int) -> tuple[PluginState, Worker]:
    """A worker process's plugin: its own state, serving its ledger on its own port."""
    state = PluginState(host="127.0.0.1", base_port=engine.base_port)
    worker = Worker(rank)
    plugin._attach_ledger(worker, state)
    assert list(state.servers) == [worker_port(engine.base_port, worker.parallel_config, rank)]
    return state, worker


def scrape(state: PluginState) -> KvPoolScrape:
    async def go() -> KvPoolScrape:
        async with ScrapeClient() as client:
            url = f"http://127.0.0.1:{state.base_port}/metrics"
            got = await KvPoolSource(url, client=client, limits=ScrapeLimits(5.0)).scrape()
        assert isinstance(got, KvPoolScrape), got
        return got

    return asyncio.run(go())


def test_the_agent_reads_each_workers_ledger_through_the_engine_port(
    engine_state: PluginState,
) -> None:
    workers = [start_worker(engine_state, rank) for rank in (0, 1)]
    try:
        got = scrape(engine_state)
    finally:
        for state, _ in workers:
            state.close()
    assert [engine.engine for engine in got.engines] == ["0"]
    assert got.worker_errors == ()
    assert [(ledger.device, ledger.rank) for ledger in got.ledgers] == [("cpu", "0"), ("cpu", "1")]
    for ledger in got.ledgers:
        assert ledger.part(WEIGHTS) == (64 * 32 + 32) * 4  # the worker's model, read there
        assert ledger.part("kv_cache") == 33 * 1024
        assert ledger.used_bytes is not None and ledger.used_bytes > 0  # this process's PSS


def test_a_worker_port_that_does_not_answer_is_an_error_of_its_own(
    engine_state: PluginState,
) -> None:
    state, _ = start_worker(engine_state, 0)  # rank 1 never started
    try:
        got = scrape(engine_state)
    finally:
        state.close()
    assert got.engines and got.engines[0].blocks_total == 32  # the engine's figures stay
    assert [ledger.rank for ledger in got.ledgers] == ["0"]
    assert [(error.source, error.kind) for error in got.worker_errors] == [
        (WORKER_SOURCE, "refused")
    ]
