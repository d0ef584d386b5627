"""The memory ledger: CPU parts from real torch tensors, GPU parts from the allocator's
stats as recorded, and the exposition the agent and the dashboard read."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.collectors.kvpool.ledger import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT,
    CUDA_GRAPHS,
    KV_CACHE,
    UNATTRIBUTED,
    WEIGHTS,
)
from kvpilot.collectors.kvpool.ledger_families import LedgerCollector
from kvpilot.collectors.kvpool.ledger_reader import (
    cuda_ledger_from,
    pool_blocks,
    read_cpu_ledger,
    storage_bytes,
)
from kvpilot.collectors.kvpool.server import PartErrors

FIXTURES = Path(__file__).parent.parent / "fixtures" / "allocator"
MIB = 1024 * 1024


def cpu_worker(num_blocks: int = 8, block_bytes: int = 4096) -> SimpleNamespace:
    model = torch.nn.Linear(64, 32)  # 64*32 + 32 float32 parameters
    # Two layers' views of one buffer, as vLLM's allocate_kv_cache hands them out.
    buffer = torch.zeros(num_blocks * block_bytes * 2, dtype=torch.int8)
    layers = [buffer[: num_blocks * block_bytes], buffer[num_blocks * block_bytes :]]
    return SimpleNamespace(model_runner=SimpleNamespace(model=model, kv_caches=layers))


def test_cpu_ledger_counts_each_storage_once_and_derives_unattributed() -> None:
    worker = cpu_worker()
    ledger = read_cpu_ledger(worker, rank="0", blocks=(8, 5), pss=lambda: 10 * MIB)
    weights, kv = ledger.part(WEIGHTS), ledger.part(KV_CACHE)
    assert weights is not None and weights.size_bytes == (64 * 32 + 32) * 4
    assert kv is not None and kv.size_bytes == 8 * 4096 * 2  # one buffer, not two views
    assert ledger.kv_block_bytes == 4096 * 2
    assert ledger.kv_used_bytes == (8 - 1 - 5) * 4096 * 2  # the null block is never used
    assert ledger.unattributed_bytes == 10 * MIB - weights.size_bytes - kv.size_bytes
    assert ledger.drift_bytes is None and ledger.headroom_bytes is None  # no budget on CPU


def test_kv_figures_absent_when_blocks_do_not_divide_the_tensors() -> None:
    ledger = read_cpu_ledger(cpu_worker(), rank="0", blocks=(7, 0), pss=lambda: None)
    assert ledger.kv_block_bytes is None and ledger.kv_used_bytes is None
    assert ledger.unattributed_bytes is None


def test_pool_blocks_reads_vllm_counters_or_says_none() -> None:
    pool = SimpleNamespace(num_gpu_blocks=101, get_num_free_blocks=lambda: 40)
    assert pool_blocks(pool) == (101, 40)
    assert pool_blocks(SimpleNamespace()) is None
    assert pool_blocks(None) is None


def test_storage_bytes_of_views() -> None:
    base = torch.zeros(100, dtype=torch.float16)
    assert storage_bytes([base[:10], base[50:], base]) == 200


def gpu_ledger():  # type: ignore[no-untyped-def]
    stats = json.loads((FIXTURES / "memory_stats_device0.json").read_text())
    total = 80 * 1024 * MIB
    return cuda_ledger_from(
        device=0,
        rank="0",
        memory_stats=stats,
        free_and_total=(total - 72 * 1024 * MIB, total),
        weights_bytes=16 * 1024 * MIB,
        graph_bytes=512 * MIB,
        context_bytes=600 * MIB,
        kv_bytes=54 * 1024 * MIB,
        blocks=(54 * 1024 + 1, 1024),
        budget_bytes=72 * 1024 * MIB - 256 * MIB,
    )


def test_gpu_ledger_from_recorded_allocator_stats() -> None:
    ledger = gpu_ledger()
    slack = ledger.part(ALLOCATOR_SLACK)
    # The recorded stats: reserved 22 MiB, allocated 14.5 MiB.
    assert slack is not None and slack.size_bytes == 22 * MIB - int(14.5 * MIB)
    assert slack.source == "torch_cuda_memory_stats"
    assert {p.name for p in ledger.parts} == {
        WEIGHTS,
        CUDA_GRAPHS,
        CUDA_CONTEXT,
        KV_CACHE,
        ALLOCATOR_SLACK,
    }
    assert ledger.used_bytes == 72 * 1024 * MIB
    assert ledger.drift_bytes == 256 * MIB
    assert ledger.headroom_bytes == 8 * 1024 * MIB + 256 * MIB
    assert ledger.unallocated_bytes == 8 * 1024 * MIB
    assert ledger.kv_block_bytes is None  # 54 GiB does not divide into 55297 blocks


def scrape(collector: LedgerCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_exposition_parts_add_up_to_used_and_name_their_source() -> None:
    ledger = gpu_ledger()
    errors = PartErrors()
    collector = LedgerCollector(
        engines=list, allocators=list, ledgers=lambda: [ledger], errors=errors, clock=lambda: 0.0
    )
    samples = scrape(collector)
    parts = {
        dict(labels)["part"]: (dict(labels)["source"], value)
        for (name, labels), value in samples.items()
        if name == "kvpool_memory_part_bytes"
    }
    assert parts[UNATTRIBUTED][1] == ledger.unattributed_bytes
    assert all(source for source, _ in parts.values())
    used = next(v for (n, _), v in samples.items() if n == "kvpool_memory_used_bytes")
    assert sum(value for _, value in parts.values()) == used
    drift = next(v for (n, _), v in samples.items() if n == "kvpool_memory_drift_bytes")
    assert drift == 256 * MIB


def test_a_failing_ledger_is_counted_not_raised() -> None:
    def broken() -> list:  # type: ignore[type-arg]
        raise RuntimeError("no device")

    errors = PartErrors()
    collector = LedgerCollector(
        engines=list, allocators=list, ledgers=broken, errors=errors, clock=lambda: 0.0
    )
    samples = scrape(collector)
    assert samples[("kvpool_plugin_errors_total", (("part", "ledger"),))] == 1
    assert not any(name.startswith("kvpool_memory_") for name, _ in samples)
