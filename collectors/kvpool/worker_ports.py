"""Where an engine's workers serve their figures, computed once for both sides of the plugin.

A worker (the model runner: on the CPU build always a process of its own, with tensor
parallelism one per rank) serves its memory ledger and allocator on
`PORT + ALLOCATOR_PORT_OFFSET + slot`, its node-local slot being `DP-local rank x local world
size + its rank on the node`. The engine core computes the same slots for its own workers
from the same parallel config and publishes them as `kvpool_worker_port`, so the agent
follows them from the one port it scrapes: nothing is guessed or probed.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import GaugeMetricFamily, Metric

from kvpilot.collectors.kvpool.listen_address import ALLOCATOR_PORT_OFFSET, WORKER_PORT_FAMILY
from kvpilot.collectors.kvpool.server import ENGINE_LABELS, EngineReading, KvPoolCollector

WORKER_LABEL = "worker"  # the worker's rank on the node, within its engine


def _whole(value: object, default: int) -> int:
    """A vLLM config figure that should be a non-negative int, else the default."""
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default
    )


def _dp_local_rank(parallel_config: object) -> int:
    # vLLM's own choice for the device slot: the local DP rank, else the DP index.
    local = getattr(parallel_config, "data_parallel_rank_local", None)
    if isinstance(local, int) and not isinstance(local, bool) and local >= 0:
        return local
    return _whole(getattr(parallel_config, "data_parallel_index", 0), 0)


def local_world_size(parallel_config: object) -> int:
    """Workers of one engine on one node (vLLM's `ParallelConfig.local_world_size`)."""
    world = _whole(getattr(parallel_config, "world_size", 1), 1) or 1
    nodes = _whole(getattr(parallel_config, "nnodes_within_dp", 1), 1) or 1
    return max(world // nodes, 1)


def worker_port(base_port: int, parallel_config: object, rank: int) -> int:
    """The port a worker of global rank `rank` serves on (its rank on the node: rank modulo
    the local world size)."""
    size = local_world_size(parallel_config)
    slot = _dp_local_rank(parallel_config) * size + rank % size
    return base_port + ALLOCATOR_PORT_OFFSET + slot


def engine_worker_ports(base_port: int, parallel_config: object) -> tuple[tuple[int, int], ...]:
    """(rank on the node, port) of every worker an engine core starts on its own node."""
    return tuple(
        (rank, worker_port(base_port, parallel_config, rank))
        for rank in range(local_world_size(parallel_config))
    )


def worker_port_families(readings: Sequence[EngineReading]) -> list[Metric]:
    """`kvpool_worker_port{engine, model_name, worker}`: the port, as the value."""
    family = GaugeMetricFamily(
        WORKER_PORT_FAMILY,
        "Port where the engine's worker of this node-local rank serves its memory ledger and "
        "allocator (on this host).",
        labels=[*ENGINE_LABELS, WORKER_LABEL],
    )
    for reading in readings:
        for rank, port in reading.worker_ports:
            family.add_metric([reading.engine, reading.model_name, str(rank)], port)
    return [family] if readings else []


class WorkerPortCollector(KvPoolCollector):
    """The plugin's collector plus the ports of each engine's workers."""

    def _engine_families(self, readings: Sequence[EngineReading]) -> list[Metric]:
        return [*super()._engine_families(readings), *worker_port_families(readings)]
