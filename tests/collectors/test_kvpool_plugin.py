"""The in-engine plugin: class patches, the step-boundary snapshot, exposition, guards.

A stand-in scheduler class (the real one needs a whole engine) holds a real vLLM
BlockPool; the plugin patches it exactly as it patches vLLM's Scheduler.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from kvpilot.collectors.kvpool import plugin
from kvpilot.collectors.kvpool.allocator import allocator_stats_from
from kvpilot.collectors.kvpool.plugin import HANDLE_ATTR, MARKER, PluginState
from kvpilot.collectors.kvpool.server import AllocatorReading, KvPoolCollector, serve
from kvpilot.collectors.promtext import parse_samples
from kvpilot.rig.server import free_port

block_pool = pytest.importorskip("vllm.v1.core.block_pool")


class StandInScheduler:
    """The attributes and methods the plugin touches on vLLM's Scheduler."""

    def __init__(self, num_blocks: int = 101, dp_rank: int = 0, pool: object | None = None):
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_rank=dp_rank),
            model_config=SimpleNamespace(served_model_name=["tiny"]),
        )
        self.block_size = 16
        self.running: list = []
        self.kv_cache_manager = SimpleNamespace(
            block_pool=pool if pool is not None else block_pool.BlockPool(num_blocks, True, 16)
        )
        self.preempted: list[str] = []

    def _preempt_request(self, request, timestamp, drop_stale_output=False):
        self.preempted.append(request)

    def update_from_output(self, scheduler_output, model_output):
        return {"step": scheduler_output}


def fresh_class() -> type:
    """A new class owning the three methods, as vLLM's Scheduler does."""
    return type(
        "Scheduler",
        (StandInScheduler,),
        {
            "__init__": lambda self, *a, **k: StandInScheduler.__init__(self, *a, **k),
            "_preempt_request": StandInScheduler._preempt_request,
            "update_from_output": StandInScheduler.update_from_output,
        },
    )


@pytest.fixture
def patched():
    """A fresh stand-in class, patched twice (idempotence), and the plugin state behind it."""
    cls = fresh_class()
    current = PluginState(host="127.0.0.1", base_port=free_port())
    plugin.patch_scheduler_class(cls, current)
    plugin.patch_scheduler_class(cls, current)
    yield cls, current
    current.close()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200
    return {(s.name, s.labels): s.value for s in parse_samples(response.text)}


def value(samples: dict, name: str, **labels: str) -> float | None:
    for (got_name, got_labels), got in samples.items():
        if got_name == name and all(dict(got_labels).get(k) == v for k, v in labels.items()):
            return got
    return None


def test_patch_is_idempotent_and_counts_preemptions(patched) -> None:
    cls, current = patched
    assert getattr(cls.__init__, MARKER) and getattr(cls._preempt_request, MARKER)
    scheduler = cls()
    before = time.time()
    scheduler._preempt_request("r1", 0.0)
    scheduler._preempt_request("r2", 0.0)
    handle = getattr(scheduler, HANDLE_ATTR)
    assert scheduler.preempted == ["r1", "r2"]  # the original still runs, once
    assert handle.preemptions_total == 2  # counted once per call despite two patches
    assert handle.last_preemption_wall_s >= before
    assert scheduler.update_from_output("s", "m") == {"step": "s"}
    assert handle.steps_total == 1
    samples = scrape(current.base_port)
    assert value(samples, "kvpool_preemptions_total", engine="0", model_name="tiny") == 2
    assert value(samples, "kvpool_scheduler_steps_total", engine="0") == 1
    assert value(samples, "kvpool_last_preemption_timestamp_seconds") >= before


def test_exposition_of_an_idle_pool(patched) -> None:
    cls, current = patched
    scheduler = cls(num_blocks=101)
    pool = scheduler.kv_cache_manager.block_pool
    held = pool.get_new_blocks(40)
    pool.free_blocks([b for b in held if b.block_id % 2 == 0])  # 20 scattered holes
    samples = scrape(current.base_port)
    free = pool.get_num_free_blocks()
    assert value(samples, "kvpool_blocks_usable", engine="0") == 100
    assert value(samples, "kvpool_blocks_free", engine="0") == free
    # Blocks 1..40 were handed out; 40 came back, so 40..100 is the longest run.
    assert value(samples, "kvpool_longest_free_run_blocks", engine="0") == 61
    ratio = value(samples, "kvpool_fragmentation_ratio", source="kv_blocks")
    assert ratio == pytest.approx(1 - 61 / free)
    assert value(samples, "kvpool_block_size_tokens") == 16
    assert value(samples, "kvpool_snapshot_age_seconds") >= 0.0
    assert all(not name.startswith("vllm:") for name, _ in samples)


def test_guarded_ratio_is_absent(patched) -> None:
    cls, current = patched
    scheduler = cls(num_blocks=101)
    pool = scheduler.kv_cache_manager.block_pool
    pool.get_new_blocks(90)  # 10 free < 16
    samples = scrape(current.base_port)
    assert value(samples, "kvpool_blocks_free") == 10
    assert value(samples, "kvpool_fragmentation_ratio") is None


def test_busy_engine_snapshot_is_taken_at_a_step_boundary(patched) -> None:
    cls, _ = patched
    scheduler = cls(num_blocks=201)
    pool = scheduler.kv_cache_manager.block_pool
    handle = getattr(scheduler, HANDLE_ATTR)
    stop = threading.Event()
    boundary_free: set[int] = set()
    mid_step_free: set[int] = set()

    def engine_loop() -> None:
        step = 0
        while not stop.is_set():
            # Mid-step the pool is 30 blocks short; the plugin must never serve that state.
            grabbed = pool.get_new_blocks(30)
            mid_step_free.add(pool.get_num_free_blocks())
            time.sleep(0.002)  # the model runs
            pool.free_blocks(grabbed)
            if step % 2 == 0:
                pool.get_new_blocks(1)  # the pool drifts between steps
            boundary_free.add(pool.get_num_free_blocks())
            scheduler.update_from_output(step, None)
            step += 1

    engine = threading.Thread(target=engine_loop, daemon=True)
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while handle.steps_total < 5:
            assert time.monotonic() < deadline, "engine thread made no steps"
            time.sleep(0.005)
        served = []
        for _ in range(8):
            reading = handle.reading()
            assert reading.snapshot is not None
            served.append(reading.snapshot.counts.blocks_free)
    finally:
        stop.set()
        engine.join(timeout=10)
    assert set(served) <= boundary_free
    assert not set(served) & mid_step_free


def test_idle_engine_is_read_directly(patched) -> None:
    cls, _ = patched
    scheduler = cls(num_blocks=101)
    handle = getattr(scheduler, HANDLE_ATTR)
    scheduler.update_from_output(0, None)  # one step, then silence
    pool = scheduler.kv_cache_manager.block_pool
    pool.get_new_blocks(7)
    deadline = time.monotonic() + 10
    while time.monotonic() - handle.last_step_s <= 0.2:  # past the idle threshold
        assert time.monotonic() < deadline
        time.sleep(0.05)
    started = time.monotonic()
    reading = handle.reading()
    assert reading.snapshot is not None and reading.snapshot.counts.blocks_free == 93
    assert time.monotonic() - started < 0.4  # did not wait for a step that never comes


def test_broken_block_pool_is_counted_not_raised(patched) -> None:
    cls, current = patched
    scheduler = cls(pool=SimpleNamespace(blocks="not a list"))
    scheduler._preempt_request("r", 0.0)
    for _ in range(2):
        samples = scrape(current.base_port)
    assert value(samples, "kvpool_blocks_free") is None
    assert value(samples, "kvpool_preemptions_total") == 1  # the other parts still serve
    assert value(samples, "kvpool_plugin_errors_total", part="blocks") == 1  # disabled once


def test_scheduler_missing_attributes(patched) -> None:
    cls, current = patched
    scheduler = cls()
    del scheduler.kv_cache_manager
    del scheduler.vllm_config  # dp rank defaults to 0
    samples = scrape(current.base_port)
    assert value(samples, "kvpool_blocks_usable") is None
    assert value(samples, "kvpool_plugin_errors_total", part="blocks") == 1


def test_port_in_use_disables_the_server_only() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        current = PluginState(host="127.0.0.1", base_port=taken.getsockname()[1])
        other = fresh_class()
        plugin.patch_scheduler_class(other, current)
        scheduler = other()  # must not raise
        scheduler._preempt_request("r", 0.0)
        assert getattr(scheduler, HANDLE_ATTR).preemptions_total == 1
        assert current.errors.counts() == {"server": 1}
        assert current.servers == {}


def test_dp_rank_offsets_the_port(patched) -> None:
    cls, current = patched
    engines = [cls(dp_rank=0), cls(dp_rank=2, num_blocks=51)]
    assert sorted(current.servers) == [current.base_port, current.base_port + 2]
    samples = scrape(current.base_port + 2)
    assert value(samples, "kvpool_blocks_usable", engine="2") == 50
    assert value(samples, "kvpool_blocks_usable", engine="0") is None  # each port, its engine
    assert value(scrape(current.base_port), "kvpool_blocks_usable", engine="0") == 100
    assert len(engines) == 2  # the plugin holds schedulers weakly; keep them alive


def test_register_without_port_is_idle(monkeypatch) -> None:
    monkeypatch.delenv(plugin.PORT_ENV, raising=False)
    monkeypatch.setattr(plugin, "_state", None)
    plugin.register()
    assert plugin.state() is None


def test_register_with_bad_port_is_idle(monkeypatch) -> None:
    monkeypatch.setenv(plugin.PORT_ENV, "not-a-port")
    monkeypatch.setattr(plugin, "_state", None)
    plugin.register()
    assert plugin.state() is None


def test_register_patches_vllm_scheduler_once(monkeypatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setenv(plugin.PORT_ENV, str(free_port()))
    monkeypatch.setattr(plugin, "_state", None)
    plugin.register()
    first = (Scheduler.__init__, Scheduler._preempt_request, Scheduler.update_from_output)
    plugin.register()
    assert (Scheduler.__init__, Scheduler._preempt_request, Scheduler.update_from_output) == first
    assert all(getattr(method, MARKER, False) for method in first)
    assert plugin.state().errors.counts() == {}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_exposition_passes_promtool(patched) -> None:
    cls, current = patched
    scheduler = cls(num_blocks=101)
    pool = scheduler.kv_cache_manager.block_pool
    pool.free_blocks(pool.get_new_blocks(30)[::3])
    scheduler._preempt_request("r", 0.0)
    current.errors.record("allocator", RuntimeError("boom"))
    segments = [{"device": 0, "total_size": 4096, "blocks": [{"size": 4096, "state": "inactive"}]}]
    stats = allocator_stats_from(
        0, {"reserved_bytes.all.current": 4096}, segments, taken_at_s=0.0, wall_time_s=0.0
    )
    allocator_server = serve(
        KvPoolCollector(
            engines=list,
            allocators=lambda: [AllocatorReading(rank="0", stats=stats)],
            errors=current.errors,
            clock=time.monotonic,
        ),
        "127.0.0.1",
        0,
    )
    try:
        for port in (current.base_port, allocator_server.port):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            assert "kvpool_" in text
            checked = subprocess.run(
                ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
            )
            assert checked.returncode == 0, checked.stdout + checked.stderr
            assert checked.stdout.strip() == "" and checked.stderr.strip() == ""
    finally:
        allocator_server.close()
