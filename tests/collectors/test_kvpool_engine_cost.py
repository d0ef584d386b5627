"""What scrapes cost vLLM's engine thread is bounded: however often the kvpool port is
scraped, at most one block-pool pass per interval runs there; and while a step is under way,
however long, no other thread reads the pool (the latest snapshot is served instead).

The engine is a thread stepping a real vLLM BlockPool as the plugin's hooks see it
(`schedule`, then `update_from_output`)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from vllm.v1.core.block_pool import BlockPool

from kvpilot.collectors.kvpool.plugin import EngineHandle
from kvpilot.collectors.kvpool.server import PartErrors


class Scheduler:
    """What the plugin reads of vLLM's scheduler: the block pool and the running requests."""

    def __init__(self, num_blocks: int) -> None:
        pool = BlockPool(num_blocks, True, 16)
        self.kv_cache_manager = SimpleNamespace(block_pool=pool)
        self.running: list[object] = []


def _scheduler(num_blocks: int) -> Scheduler:
    return Scheduler(num_blocks)


def _handle(scheduler: Scheduler, **timing: float) -> EngineHandle:
    return EngineHandle(
        scheduler,
        engine="0",
        model_name="m",
        errors=PartErrors(),
        clock=time.monotonic,
        wall_clock=time.time,
        **timing,
    )


class Engine:
    """A thread that steps: schedule, the model runs (`step_s`), update_from_output."""

    def __init__(self, scheduler: Scheduler, handle: EngineHandle, step_s: float):
        self.pool = scheduler.kv_cache_manager.block_pool
        self.handle = handle
        self.step_s = step_s
        self.mid_step_free: set[int] = set()
        self.in_step = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.handle.on_step_start()
            grabbed = self.pool.get_new_blocks(30)  # mid-step the pool is 30 blocks short
            self.mid_step_free.add(self.pool.get_num_free_blocks())
            self.in_step.set()
            self.stop.wait(self.step_s)
            self.in_step.clear()
            self.pool.free_blocks(grabbed)
            self.handle.on_step_end()

    def __enter__(self) -> Engine:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def test_a_scrape_storm_costs_the_engine_one_pass_per_interval() -> None:
    scheduler = _scheduler(20_001)
    handle = _handle(scheduler, min_interval_s=1.0)
    served = []
    with Engine(scheduler, handle, step_s=0.002):

        def scrape_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                served.append(handle.reading().snapshot)

        scrapers = [threading.Thread(target=scrape_for, args=(1.5,)) for _ in range(4)]
        began = time.monotonic()
        for t in scrapers:
            t.start()
        for t in scrapers:
            t.join()
        elapsed = time.monotonic() - began
    assert len(served) > 100, "the scrapers barely ran"
    assert handle.snapshots_total <= elapsed / 1.0 + 2, f"{handle.snapshots_total} passes"
    assert handle.snapshot_seconds_total < 0.1 * elapsed
    assert all(s is not None for s in served[1:])


def test_a_long_step_is_never_read_from_another_thread() -> None:
    scheduler = _scheduler(201)
    handle = _handle(scheduler, min_interval_s=0.0, wait_s=0.1, idle_after_s=0.2)
    assert handle.reading().snapshot is not None  # idle: read at once, and kept
    free = []
    with Engine(scheduler, handle, step_s=0.6) as engine:  # each step outlasts the wait
        for _ in range(4):
            assert engine.in_step.wait(10)
            steps = handle.steps_total
            time.sleep(0.3)  # well into the step: past the idle threshold, none ended lately
            snap = handle.reading().snapshot
            if snap is not None:
                free.append(snap.counts.blocks_free)
            deadline = time.monotonic() + 10
            while handle.steps_total == steps:  # the next scrape falls into the next step
                assert time.monotonic() < deadline, "the engine stopped stepping"
                time.sleep(0.01)
    assert len(free) == 4, "no snapshot served while the engine was busy"
    assert not set(free) & engine.mid_step_free, "the pool was read mid-step"
