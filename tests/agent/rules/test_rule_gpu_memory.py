from __future__ import annotations

from kvpilot.agent.app.exposition import process_owner
from kvpilot.agent.rules.config import GpuMemoryGrowthConfig, GpuNeighbourPressureConfig
from kvpilot.agent.rules.gpu_memory import (
    GpuMemoryGrowthRule,
    GpuNeighbourPressureRule,
    slope_per_s,
)
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import GpuProcess
from tests.agent.rules.rules_helpers import (
    GIB,
    Driver,
    engine,
    gpu,
    instance,
    label,
    nvml,
    only,
    proc,
)

MIB = 1024 * 1024


def growth(**cfg: object) -> GpuMemoryGrowthRule:
    return GpuMemoryGrowthRule(GpuMemoryGrowthConfig(**cfg))  # type: ignore[arg-type]


def pressure(**cfg: object) -> GpuNeighbourPressureRule:
    return GpuNeighbourPressureRule(GpuNeighbourPressureConfig(**cfg))  # type: ignore[arg-type]


def feed_growth(driver: Driver, per_minute_bytes: int, minutes: int, *, pid: int = 100):
    out = []
    for m in range(minutes + 1):
        t = 60.0 * m
        used = 60 * GIB + per_minute_bytes * m
        state = nvml(t, gpu([proc(pid, used, server=True), proc(9, GIB, server=False)]))
        out = driver.tick(t, gpu_state=state)
    return out


def test_slope_fit() -> None:
    assert slope_per_s([(0.0, 10.0), (1.0, 12.0), (2.0, 14.0)]) == 2.0


def test_leak_slope_fires() -> None:
    driver = Driver(growth(window_s=1800))
    c = only(feed_growth(driver, 20 * MIB, 30))
    assert c.active is True
    assert c.value is not None and abs(c.value - 20 * MIB / 60) < 1
    assert label(c, "alertname") == "VllmGpuMemoryGrowth"
    assert label(c, "gpu") == "0"
    assert "MiB/min" in c.summary


def test_flat_memory_does_not_fire() -> None:
    c = only(feed_growth(Driver(growth(window_s=1800)), 0, 30))
    assert c.active is False


def test_slow_growth_below_threshold_does_not_fire() -> None:
    # 0.5 MiB/min is under the default 1 MiB/min slope.
    c = only(feed_growth(Driver(growth(window_s=1800)), MIB // 2, 30))
    assert c.active is False


def test_growth_is_unknown_until_the_window_is_covered() -> None:
    c = only(feed_growth(Driver(growth(window_s=1800)), 20 * MIB, 10))
    assert c.active is None
    assert "collecting history" in (c.reason or "")


def test_a_new_server_process_starts_a_new_history() -> None:
    driver = Driver(growth(window_s=1800))
    feed_growth(driver, 20 * MIB, 30, pid=100)
    state = nvml(1900.0, gpu([proc(200, 60 * GIB, server=True)]))
    c = only(driver.tick(1900.0, gpu_state=state))
    assert c.active is None  # the old process's readings do not count for the new one


def test_unknown_per_process_memory_is_unknown() -> None:
    state = nvml(1.0, gpu([proc(100, None, server=True)]))
    c = only(Driver(growth()).tick(1.0, gpu_state=state))
    assert c.active is None
    assert "per-process" in (c.reason or "")


def test_no_nvml_and_no_dcgm_is_unknown_with_the_reason_and_so_is_an_nvml_error() -> None:
    driver = Driver(growth())
    c = only(driver.tick(1.0))
    assert c.active is None
    assert "NVML is not visible" in (c.reason or "") and "dcgm_prometheus_url" in (c.reason or "")
    only(driver.tick(2.0, gpu_state=nvml(2.0, gpu([proc(100, GIB, server=True)]))))
    c = only(driver.tick(3.0, gpu_state=SourceError("nvml", "error", "driver hiccup")))
    assert c.active is None
    assert label(c, "gpu") == "0"


def test_neighbours_taking_the_restart_memory_fire() -> None:
    # 80 GiB GPU, server wants 0.9 x 80 = 72 GiB; neighbours hold 12 GiB.
    engines = [engine(1.0, cache_config=(("gpu_memory_utilization", "0.9"),))]
    procs = [proc(100, 60 * GIB, server=True), proc(9, 12 * GIB, server=False)]
    c = only(Driver(pressure()).tick(1.0, engines=engines, gpu_state=nvml(1.0, gpu(procs))))
    assert c.active is True
    assert label(c, "alertname") == "VllmGpuNeighbourPressure"
    assert c.value is not None and c.value < 1.0
    assert "gpu_memory_utilization 0.9" in c.summary


def test_small_neighbours_leave_room() -> None:
    engines = [engine(1.0, cache_config=(("gpu_memory_utilization", "0.8"),))]
    procs = [proc(100, 60 * GIB, server=True), proc(9, 2 * GIB, server=False)]
    c = only(Driver(pressure()).tick(1.0, engines=engines, gpu_state=nvml(1.0, gpu(procs))))
    assert c.active is False
    assert c.value is not None and c.value > 1.0


def test_without_utilization_the_servers_own_usage_is_the_need() -> None:
    procs = [proc(100, 40 * GIB, server=True), proc(9, 30 * GIB, server=False)]
    driver = Driver(pressure(), instance("vllm-0", role="canary"))
    c = only(driver.tick(1.0, gpu_state=nvml(1.0, gpu(procs))))
    # Free after stop: 80 - 0.5 - 30 = 49.5 GiB >= 40 x 1.05.
    assert c.active is False
    assert "what the server holds now" in c.summary
    assert label(c, "role") == "canary"


def test_only_gpus_with_the_instances_processes_count() -> None:
    procs_elsewhere = [proc(9, 70 * GIB, server=False)]
    state = nvml(1.0, gpu([proc(100, GIB, server=True)], index=0), gpu(procs_elsewhere, index=1))
    out = Driver(pressure()).tick(1.0, gpu_state=state)
    assert [label(c, "gpu") for c in out] == ["0"]
    # A server process that is another instance's counts as a neighbour here.
    mine_only = Driver(pressure(), instance(pids=frozenset({100})))
    other_server = [proc(100, 10 * GIB, server=True), proc(300, 65 * GIB, server=True)]
    engines = [engine(1.0, cache_config=(("gpu_memory_utilization", "0.5"),))]
    c = only(mine_only.tick(1.0, engines=engines, gpu_state=nvml(1.0, gpu(other_server))))
    # Left after a stop: 4.5 free + this server's 10 GiB, short of 40 GiB; were the other
    # server's 65 GiB counted as ours, 79.5 GiB would look free.
    assert c.active is True
    assert "1 other processes" in (dict(c.annotations).get("description") or "")


def test_processes_this_container_cannot_map_make_both_rules_unknown_not_silent() -> None:
    # NVIDIA_VISIBLE_DEVICES=all in a pod: NVML lists host PIDs the container cannot see.
    unmapped = GpuProcess(host_pid=4242, container_pid=None, used_bytes=60 * GIB, is_server=False)
    for rule in (growth(), pressure()):
        c = only(Driver(rule).tick(1.0, gpu_state=nvml(1.0, gpu([unmapped]))))
        assert c.active is None
        assert "cannot map" in (c.reason or ""), c.reason


def test_unmapped_processes_are_owned_by_unknown_not_a_neighbour() -> None:
    unmapped = GpuProcess(host_pid=4242, container_pid=None, used_bytes=GIB, is_server=False)
    assert process_owner(unmapped) == "unknown"
    assert process_owner(proc(7, GIB, server=False)) == "neighbour"
    assert process_owner(proc(8, GIB, server=True)) == "server"
