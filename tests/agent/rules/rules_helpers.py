"""Build real samples, snapshots and windows tick by tick for rule tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvpilot.agent.model import Condition, Instance
from kvpilot.agent.readings.snapshot import Snapshot
from kvpilot.agent.rules.base import Rule, RuleContext
from kvpilot.collectors.dcgm import DcgmSnapshot
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.fragmentation import kv_blocks_fragmentation
from kvpilot.collectors.gpu_samples import GpuProcess, GpuSample, NvmlSnapshot
from kvpilot.collectors.kvpool.client import AllocatorSample, KvBlockSample, KvPoolScrape
from kvpilot.collectors.vllm_metrics import EngineSample, VllmScrape
from kvpilot.collectors.window import RollingWindow

MODEL = "tiny"
WALL_OFFSET_S = 1_700_000_000.0
GIB = 1024**3
NO_GPU = SourceError("nvml", "unavailable", "no NVML library")


def instance(name: str = "vllm-0", role: str = "stable", pids: frozenset[int] = frozenset()):
    return Instance(
        name=name,
        role=role,  # type: ignore[arg-type]
        url="http://127.0.0.1:8000",
        kvpool_url=None,
        pids=pids,
        main_pid=None,
        argv=None,
        started_at_wall_s=None,
    )


def engine(t: float, engine_id: str = "0", **fields: object) -> EngineSample:
    return EngineSample(
        model_name=MODEL,
        engine=engine_id,
        taken_at_s=t,
        wall_time_s=t + WALL_OFFSET_S,
        **fields,  # type: ignore[arg-type]
    )


def kv_block(
    *, total: int, free: int, longest: int, preemptions: int | None = None, engine_id: str = "0"
) -> KvBlockSample:
    """A plugin sample whose fragmentation comes from the collectors' one formula."""
    return KvBlockSample(
        taken_at_s=0.0,
        engine=engine_id,
        model_name=MODEL,
        blocks_total=total,
        blocks_free=free,
        blocks_free_cached=0,
        blocks_empty=free,
        longest_free_run_blocks=longest,
        fragmentation=kv_blocks_fragmentation(free, longest, total),
        internal_fragmentation_slots=0,
        internal_fragmentation_ratio=0.0,
        requests_running=1,
        block_size_tokens=16,
        preemptions_total=preemptions,
        last_preemption_wall_s=None,
        scheduler_steps_total=0,
        snapshot_age_s=0.0,
    )


def with_stamp(sample: KvBlockSample, t: float) -> KvBlockSample:
    """The plugin sample stamped as the window needs it."""
    return dataclasses.replace(sample, taken_at_s=t)


def allocator(ratio: float | None, free_in_reserved: int = GIB) -> AllocatorSample:
    return AllocatorSample(
        device="0",
        rank="0",
        reserved_bytes=4 * GIB,
        allocated_bytes=3 * GIB,
        active_bytes=3 * GIB,
        inactive_split_bytes=0,
        free_in_reserved_bytes=free_in_reserved,
        largest_free_block_bytes=GIB // 2,
        segments=10,
        fragmentation_ratio=ratio,
    )


def gpu(
    processes: Sequence[GpuProcess] | None,
    *,
    total: int = 80 * GIB,
    free: int | None = None,
    index: int = 0,
) -> GpuSample:
    used = None if processes is None else sum(p.used_bytes or 0 for p in processes)
    if free is None and used is not None:
        free = total - used - GIB // 2  # the driver's own share
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        name="H100",
        total_bytes=total,
        used_bytes=None if free is None else total - free,
        free_bytes=free,
        reserved_bytes=None,
        utilization_gpu_ratio=None,
        utilization_memory_ratio=None,
        processes=None if processes is None else tuple(processes),
        mig_instances=(),
    )


def proc(pid: int, used: int | None, *, server: bool) -> GpuProcess:
    return GpuProcess(host_pid=pid, container_pid=pid, used_bytes=used, is_server=server)


def nvml(t: float, *gpus: GpuSample) -> NvmlSnapshot:
    return NvmlSnapshot(
        taken_at_s=t, wall_time_s=t + WALL_OFFSET_S, driver_version="550", gpus=gpus
    )


class Driver:
    """Feeds ticks into real windows and evaluates one rule on each tick's context."""

    def __init__(self, rule: Rule, inst: Instance | None = None) -> None:
        self.rule = rule
        self.instance = inst or instance()
        self.vllm_window = RollingWindow(retention_s=3600.0)
        self.kvpool_window = RollingWindow(retention_s=3600.0)

    def tick(
        self,
        t: float,
        *,
        engines: Sequence[EngineSample] | SourceError = (),
        kv_blocks: Sequence[KvBlockSample] | None = None,
        allocators: Sequence[AllocatorSample] = (),
        kvpool_error: SourceError | None = None,
        gpu_state: NvmlSnapshot | SourceError = NO_GPU,
        instance_state: str | None = None,
        instance_state_reason: str | None = None,
        dcgm: DcgmSnapshot | SourceError | None = None,
    ) -> list[Condition]:
        if isinstance(engines, SourceError):
            vllm: VllmScrape | SourceError = engines
        else:
            vllm = VllmScrape(
                taken_at_s=t,
                wall_time_s=t + WALL_OFFSET_S,
                engines=tuple(engines),
                vllm_version="0.32.0",
            )
            self.vllm_window.add(vllm)
        kvpool: KvPoolScrape | SourceError | None = None
        if kvpool_error is not None:
            kvpool = kvpool_error
        elif kv_blocks is not None or allocators:
            stamped = tuple(with_stamp(s, t) for s in kv_blocks or ())
            kvpool = KvPoolScrape(
                taken_at_s=t,
                wall_time_s=t + WALL_OFFSET_S,
                engines=stamped,
                allocators=tuple(allocators),
            )
            self.kvpool_window.add(kvpool)
        snapshot = Snapshot(
            taken_at_s=t,
            wall_time_s=t + WALL_OFFSET_S,
            vllm=vllm,
            kvpool=kvpool,
            nvml=gpu_state,
            durations_s=(),
            dcgm=dcgm,
        )
        ctx = RuleContext(
            snapshot=snapshot,
            vllm_window=self.vllm_window,
            kvpool_window=self.kvpool_window,
            figures=(),
            instance=self.instance,
            instance_state=instance_state,
            instance_state_reason=instance_state_reason,
        )
        return self.rule.evaluate(ctx)


def only(conditions: list[Condition]) -> Condition:
    assert len(conditions) == 1, conditions
    return conditions[0]


def label(condition: Condition, name: str) -> str | None:
    return dict(condition.labels).get(name)


def annotation(condition: Condition, name: str) -> str | None:
    return dict(condition.annotations).get(name)
