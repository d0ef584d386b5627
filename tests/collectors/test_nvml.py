"""The NVML collector against the real ``pynvml`` with a fake C library underneath."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import GpuSample, NvmlSnapshot
from kvpilot.collectors.nvml import NvmlCollector, error_reason
from kvpilot.collectors.pidmap import PidMapper
from tests.fakes.nvml import (
    GIB,
    OTHER_NAMESPACE,
    FakeGpu,
    FakeMigDevice,
    FakeNvmlLibrary,
    FakeProcEntry,
    FakeProcess,
    install,
    write_proc,
)

MIB = 1 << 20
RETRY_S = 300.0
LOGGER = "kvpilot.collectors.nvml"

# Host PIDs as NVML reports them, and the /proc that maps them (the sidecar is PID 7 in its pod).
SIDECAR = FakeProcEntry(ns_pids=(5000, 7), parent_pid=4990)
VLLM_API = FakeProcEntry(ns_pids=(6001, 1), parent_pid=4991)
VLLM_ENGINE = FakeProcEntry(ns_pids=(6002, 30), parent_pid=6001)
VLLM_WORKER = FakeProcEntry(ns_pids=(6003, 31), parent_pid=6002)
NEIGHBOUR = FakeProcEntry(ns_pids=(7001, 1), parent_pid=4992, namespace=OTHER_NAMESPACE)
SERVER_PIDS = frozenset({1})  # what the runtime knows: the server's PID in our namespace


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(
            uuid="GPU-aaaa",
            total_bytes=80 * GIB,
            used_bytes=60 * GIB,
            reserved_bytes=600 * MIB,
            utilization_gpu_percent=87,
            utilization_memory_percent=41,
            processes=(
                FakeProcess(pid=6002, used_bytes=50 * GIB),
                FakeProcess(pid=6003, used_bytes=2 * GIB),
                FakeProcess(pid=7001, used_bytes=8 * GIB),
            ),
        ),
        FakeGpu(
            uuid="GPU-bbbb",
            name="NVIDIA A100-SXM4-40GB",
            total_bytes=40 * GIB,
            used_bytes=3 * GIB,
            reserved_bytes=400 * MIB,
            processes=(FakeProcess(pid=7001, used_bytes=3 * GIB),),
        ),
    ]


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    return write_proc(
        tmp_path / "proc", [VLLM_API, VLLM_ENGINE, VLLM_WORKER, NEIGHBOUR], own=SIDECAR
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def use_nvml() -> Iterator[Callable[[FakeNvmlLibrary | None], None]]:
    uninstallers: list[Callable[[], None]] = []
    yield lambda fake: uninstallers.append(install(fake))
    for uninstall in reversed(uninstallers):
        uninstall()


@pytest.fixture
def make_collector(proc_root: Path, clock: Clock) -> Iterator[Callable[[], NvmlCollector]]:
    made: list[NvmlCollector] = []

    def make() -> NvmlCollector:
        collector = NvmlCollector(
            server_pids=lambda: SERVER_PIDS,
            pid_mapper=PidMapper(proc_root),
            clock=clock,
            wall_clock=lambda: 1_700_000_000.5,
            retry_after_s=RETRY_S,
        )
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.close()


def snapshot_of(result: NvmlSnapshot | SourceError) -> NvmlSnapshot:
    assert isinstance(result, NvmlSnapshot), result
    return result


def test_two_gpus_with_server_and_neighbour_processes(use_nvml, make_collector, clock) -> None:
    gpus = two_gpus()
    use_nvml(FakeNvmlLibrary(gpus, driver_version="550.54.15"))

    snapshot = snapshot_of(make_collector().collect())

    assert snapshot.taken_at_s == clock.now_s
    assert snapshot.wall_time_s == 1_700_000_000.5
    assert snapshot.driver_version == "550.54.15"
    assert snapshot.errors == ()
    assert [gpu.uuid for gpu in snapshot.gpus] == [gpu.uuid for gpu in gpus]
    for sample, spec in zip(snapshot.gpus, gpus, strict=True):
        assert sample.errors == ()
        assert sample.name == spec.name
        assert sample.total_bytes == spec.total_bytes
        assert sample.used_bytes == spec.used_bytes
        assert sample.reserved_bytes == spec.reserved_bytes
        assert sample.free_bytes == spec.total_bytes - spec.reserved_bytes - spec.used_bytes
        assert sample.utilization_gpu_ratio == pytest.approx(spec.utilization_gpu_percent / 100)
        assert sample.mig_instances == ()
    first = snapshot.gpus[0]
    assert first.utilization_memory_ratio == pytest.approx(0.41)
    by_pid = {process.host_pid: process for process in first.processes or ()}
    assert {pid: (p.container_pid, p.is_server) for pid, p in by_pid.items()} == {
        6002: (30, True),  # the engine: a child of the server's PID 1
        6003: (31, True),  # a worker: a grandchild
        7001: (None, False),  # another pod's PID 1 is not ours
    }
    assert by_pid[6002].used_bytes == 50 * GIB
    assert first.server_used_bytes() == 52 * GIB
    assert first.neighbour_used_bytes() == 8 * GIB
    assert snapshot.gpus[1].server_used_bytes() == 0
    assert snapshot.gpus[1].neighbour_used_bytes() == 3 * GIB


def test_snapshot_values_are_frozen(use_nvml, make_collector) -> None:
    use_nvml(FakeNvmlLibrary(two_gpus()))
    sample = snapshot_of(make_collector().collect()).gpus[0]

    with pytest.raises(AttributeError):
        sample.used_bytes = 0  # type: ignore[misc]


def test_nvml_is_initialised_lazily_once(use_nvml, make_collector) -> None:
    fake = FakeNvmlLibrary(two_gpus())
    use_nvml(fake)
    collector = make_collector()
    assert fake.init_calls == 0

    for _ in range(3):
        snapshot_of(collector.collect())

    assert fake.init_calls == 1
    collector.close()
    assert "nvmlShutdown" in fake.calls


def test_mig_instances_with_their_own_memory(use_nvml, make_collector) -> None:
    instances = (
        FakeMigDevice(
            uuid="MIG-1111",
            gpu_instance_id=1,
            compute_instance_id=0,
            total_bytes=40 * GIB,
            used_bytes=30 * GIB,
            processes=(FakeProcess(pid=6002, used_bytes=None),),
        ),
        FakeMigDevice(
            uuid="MIG-2222",
            gpu_instance_id=2,
            compute_instance_id=0,
            total_bytes=20 * GIB,
            used_bytes=5 * GIB,
            processes=(FakeProcess(pid=7001, used_bytes=None),),
        ),
    )
    use_nvml(FakeNvmlLibrary([FakeGpu(uuid="GPU-mig", used_bytes=35 * GIB, mig_devices=instances)]))

    gpu = snapshot_of(make_collector().collect()).gpus[0]

    # Utilization has no meaning for a GPU split into instances: unknown, with the reason.
    assert gpu.utilization_gpu_ratio is None
    assert gpu.errors == ("utilization: not_supported",)
    assert gpu.used_bytes == 35 * GIB
    assert [mig.uuid for mig in gpu.mig_instances] == ["MIG-1111", "MIG-2222"]
    for mig, spec in zip(gpu.mig_instances, instances, strict=True):
        assert mig.errors == ()
        assert mig.gpu_index == 0
        assert (mig.gpu_instance_id, mig.compute_instance_id) == (spec.gpu_instance_id, 0)
        assert (mig.total_bytes, mig.used_bytes) == (spec.total_bytes, spec.used_bytes)
        assert mig.free_bytes == spec.total_bytes - spec.used_bytes
    first, second = gpu.mig_instances
    assert first.mig_index == 0
    assert second.mig_index == 1
    assert [(p.host_pid, p.used_bytes, p.is_server) for p in first.processes or ()] == [
        (6002, None, True)
    ]
    assert [(p.host_pid, p.is_server) for p in second.processes or ()] == [(7001, False)]


def test_v1_only_driver_falls_back_and_stops_asking(use_nvml, make_collector) -> None:
    gpus = two_gpus()
    fake = FakeNvmlLibrary(gpus, missing_functions=frozenset({"nvmlDeviceGetMemoryInfo_v2"}))
    use_nvml(fake)
    collector = make_collector()

    first = snapshot_of(collector.collect())
    snapshot_of(collector.collect())

    sample, spec = first.gpus[0], gpus[0]
    assert sample.reserved_bytes is None
    # v1 counts the driver's reserve as used.
    assert sample.used_bytes == spec.used_bytes + spec.reserved_bytes
    assert sample.free_bytes == spec.total_bytes - spec.used_bytes - spec.reserved_bytes
    assert sample.errors == ()
    assert collector.errors_by_reason() == {}
    assert fake.lookups.count("nvmlDeviceGetMemoryInfo_v2") == 1  # asked once, then remembered
    assert fake.calls.count("nvmlDeviceGetMemoryInfo") == 2 * len(gpus)


def test_v2_refused_for_one_device_only(use_nvml, make_collector) -> None:
    gpus = two_gpus()
    gpus[1] = FakeGpu(
        uuid="GPU-bbbb",
        total_bytes=40 * GIB,
        used_bytes=3 * GIB,
        fail={"nvmlDeviceGetMemoryInfo_v2": pynvml.NVML_ERROR_NOT_SUPPORTED},
    )
    fake = FakeNvmlLibrary(gpus)
    use_nvml(fake)
    collector = make_collector()

    snapshot_of(collector.collect())
    snapshot = snapshot_of(collector.collect())

    assert snapshot.gpus[0].reserved_bytes == gpus[0].reserved_bytes
    assert snapshot.gpus[1].reserved_bytes is None
    assert snapshot.gpus[1].used_bytes == gpus[1].used_bytes + gpus[1].reserved_bytes
    assert fake.calls.count("nvmlDeviceGetMemoryInfo_v2") == 4  # still asked every time


def test_older_process_call_when_v3_is_missing(use_nvml, make_collector) -> None:
    fake = FakeNvmlLibrary(
        two_gpus(), missing_functions=frozenset({"nvmlDeviceGetComputeRunningProcesses_v3"})
    )
    use_nvml(fake)

    gpu = snapshot_of(make_collector().collect()).gpus[0]

    assert [p.host_pid for p in gpu.processes or ()] == [6002, 6003, 7001]
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in fake.calls


def test_no_process_call_at_all(use_nvml, make_collector) -> None:
    missing = {"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"}
    use_nvml(FakeNvmlLibrary(two_gpus(), missing_functions=frozenset(missing)))
    collector = make_collector()

    gpu = snapshot_of(collector.collect()).gpus[0]

    assert gpu.processes is None
    assert gpu.server_used_bytes() is None
    assert gpu.errors == ("compute_processes: function_not_found",)
    assert gpu.total_bytes == 80 * GIB


@pytest.mark.parametrize(
    ("function", "code", "reading", "reason"),
    [
        (
            "nvmlDeviceGetMemoryInfo_v2",
            pynvml.NVML_ERROR_GPU_IS_LOST,
            "used_bytes",
            "memory_info_v2: gpu_is_lost",
        ),
        (
            "nvmlDeviceGetMemoryInfo_v2",
            pynvml.NVML_ERROR_NO_PERMISSION,
            "total_bytes",
            "memory_info_v2: no_permission",
        ),
        (
            "nvmlDeviceGetUtilizationRates",
            pynvml.NVML_ERROR_NOT_SUPPORTED,
            "utilization_gpu_ratio",
            "utilization: not_supported",
        ),
        (
            "nvmlDeviceGetUtilizationRates",
            pynvml.NVML_ERROR_TIMEOUT,
            "utilization_memory_ratio",
            "utilization: timeout",
        ),
        ("nvmlDeviceGetUUID", pynvml.NVML_ERROR_UNKNOWN, "uuid", "uuid: unknown"),
        (
            "nvmlDeviceGetName",
            pynvml.NVML_ERROR_INSUFFICIENT_SIZE,
            "name",
            "name: insufficient_size",
        ),
        (
            "nvmlDeviceGetComputeRunningProcesses_v3",
            pynvml.NVML_ERROR_NO_PERMISSION,
            "processes",
            "compute_processes_v3: no_permission",
        ),
        (
            "nvmlDeviceGetComputeRunningProcesses_v3",
            pynvml.NVML_ERROR_GPU_IS_LOST,
            "processes",
            "compute_processes_v3: gpu_is_lost",
        ),
        (
            "nvmlDeviceGetMigMode",
            pynvml.NVML_ERROR_NO_PERMISSION,
            "mig_instances",
            "mig_mode: no_permission",
        ),
    ],
)
def test_one_failing_call_degrades_only_that_reading(
    use_nvml, make_collector, function, code, reading, reason
) -> None:
    healthy = two_gpus()
    uninstall = install(FakeNvmlLibrary(healthy))
    reference = snapshot_of(make_collector().collect()).gpus[1]
    uninstall()
    broken = list(healthy)
    broken[1] = FakeGpu(**{**_spec_fields(healthy[1]), "fail": {function: code}})
    use_nvml(FakeNvmlLibrary(broken))
    collector = make_collector()

    snapshot = snapshot_of(collector.collect())
    snapshot_of(collector.collect())

    good, bad = snapshot.gpus
    assert good.errors == ()
    assert good.processes is not None
    assert bad.errors == (reason,)
    if reading != "mig_instances":
        assert getattr(reference, reading) is not None
        assert getattr(bad, reading) is None
    # Every other reading of the broken GPU is intact.
    for name in GpuSample.__slots__:
        if name not in (reading, "errors", *_COUPLED.get(reading, ())):
            assert getattr(bad, name) == getattr(reference, name), name
    query, _, why = reason.partition(": ")
    assert collector.errors_by_reason() == {f"{query}:{why}": 2}


# Readings that one NVML call returns together.
_COUPLED = {
    "used_bytes": ("total_bytes", "free_bytes", "reserved_bytes"),
    "total_bytes": ("used_bytes", "free_bytes", "reserved_bytes"),
    "utilization_gpu_ratio": ("utilization_memory_ratio",),
    "utilization_memory_ratio": ("utilization_gpu_ratio",),
}


def _spec_fields(gpu: FakeGpu) -> dict:
    return {name: getattr(gpu, name) for name in FakeGpu.__slots__}


def test_a_gpu_without_a_handle_is_unreadable_alone(use_nvml, make_collector) -> None:
    gpus = two_gpus()
    gpus[0] = FakeGpu(
        **{
            **_spec_fields(gpus[0]),
            "fail": {"nvmlDeviceGetHandleByIndex_v2": pynvml.NVML_ERROR_GPU_IS_LOST},
        }
    )
    use_nvml(FakeNvmlLibrary(gpus))

    lost, fine = snapshot_of(make_collector().collect()).gpus

    assert lost.errors == ("handle: gpu_is_lost",)
    assert (lost.uuid, lost.total_bytes, lost.processes) == (None, None, None)
    assert fine.uuid == "GPU-bbbb"
    assert fine.total_bytes == 40 * GIB


def test_value_not_available_is_none_not_zero(use_nvml, make_collector) -> None:
    gpu = FakeGpu(uuid="GPU-wddm", processes=(FakeProcess(pid=6002, used_bytes=None),))
    use_nvml(FakeNvmlLibrary([gpu]))

    sample = snapshot_of(make_collector().collect()).gpus[0]

    assert [(p.host_pid, p.used_bytes) for p in sample.processes or ()] == [(6002, None)]
    assert sample.server_used_bytes() is None
    assert sample.neighbour_used_bytes() == 0


def test_no_library_is_unavailable_once_and_cheap(
    use_nvml, make_collector, clock, monkeypatch, caplog
) -> None:
    use_nvml(None)
    opened: list[str] = []
    missing_cdll = pynvml.CDLL

    def counting_cdll(name: str, *args, **kwargs):
        opened.append(name)
        return missing_cdll(name, *args, **kwargs)

    monkeypatch.setattr(pynvml, "CDLL", counting_cdll)
    collector = make_collector()

    with caplog.at_level(logging.INFO, logger=LOGGER):
        results = []
        for step_s in (0.0, 1.0, 120.0, RETRY_S - 1):
            clock.now_s = 1000.0 + step_s
            results.append(collector.collect())
        assert len(opened) == 1  # no retry before the interval
        clock.now_s = 1000.0 + RETRY_S
        results.append(collector.collect())

    assert len(opened) == 2
    first = results[0]
    assert isinstance(first, SourceError)
    assert first.source == "nvml"
    assert first.kind == "unavailable"
    assert first.message.startswith("NVML disabled, because ")
    assert "libnvidia-ml.so.1" in first.message
    assert all(result == first for result in results)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "libnvidia-ml.so.1" in warnings[0].getMessage()
    assert collector.errors_by_reason() == {"init:library_not_found": 2}


def test_driver_not_loaded_then_loaded(use_nvml, make_collector, clock, caplog) -> None:
    fake = FakeNvmlLibrary(two_gpus(), init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    use_nvml(fake)
    collector = make_collector()

    with caplog.at_level(logging.INFO, logger=LOGGER):
        unavailable = collector.collect()
        clock.now_s += 10
        again = collector.collect()
        fake.init_error = None
        clock.now_s += 10
        still_waiting = collector.collect()
        clock.now_s += RETRY_S
        recovered = collector.collect()

    assert isinstance(unavailable, SourceError)
    assert unavailable.kind == "unavailable"
    assert "driver is not loaded" in unavailable.message
    assert again is unavailable
    assert still_waiting is unavailable
    assert fake.init_calls == 2
    assert len(snapshot_of(recovered).gpus) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert sum("NVML disabled" in m for m in messages) == 1
    assert sum("available again" in m for m in messages) == 1


def test_driver_lost_mid_run_makes_the_source_unavailable(use_nvml, make_collector, clock) -> None:
    gpus = two_gpus()
    fake = FakeNvmlLibrary(gpus)
    use_nvml(fake)
    collector = make_collector()
    snapshot_of(collector.collect())

    fake.fail["nvmlDeviceGetMemoryInfo_v2"] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    lost = collector.collect()
    clock.now_s += 1
    cached = collector.collect()
    del fake.fail["nvmlDeviceGetMemoryInfo_v2"]
    clock.now_s += RETRY_S
    back = collector.collect()

    assert isinstance(lost, SourceError)
    assert lost.kind == "unavailable"
    assert cached is lost
    assert fake.init_calls == 2  # re-initialised after the retry interval
    assert snapshot_of(back).gpus[0].total_bytes == gpus[0].total_bytes
    assert collector.errors_by_reason() == {"nvml:driver_not_loaded": 1}


def test_listing_gpus_fails(use_nvml, make_collector) -> None:
    use_nvml(FakeNvmlLibrary(two_gpus(), fail={"nvmlDeviceGetCount_v2": pynvml.NVML_ERROR_UNKNOWN}))
    collector = make_collector()

    result = collector.collect()

    assert isinstance(result, SourceError)
    assert result.kind == "error"
    assert "unknown" in result.message
    assert collector.errors_by_reason() == {"device_count:unknown": 1}


def test_driver_version_failure_is_recorded_on_the_snapshot(use_nvml, make_collector) -> None:
    use_nvml(
        FakeNvmlLibrary(two_gpus(), fail={"nvmlSystemGetDriverVersion": pynvml.NVML_ERROR_UNKNOWN})
    )

    snapshot = snapshot_of(make_collector().collect())

    assert snapshot.driver_version is None
    assert snapshot.errors == ("driver_version: unknown",)
    assert snapshot.gpus[0].errors == ()


def test_error_reason_names() -> None:
    assert error_reason(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)) == "gpu_is_lost"
    assert error_reason(pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)) == (
        "lib_rm_version_mismatch"
    )
    assert error_reason(pynvml.NVMLError(12345)) == "nvml_error_12345"


def test_uninstall_restores_pynvml() -> None:
    before = (pynvml.nvmlLib, pynvml.CDLL, pynvml._nvmlLib_refcount)
    fake = FakeNvmlLibrary(two_gpus())
    uninstall = install(fake)
    collector = NvmlCollector(pid_mapper=PidMapper("/nonexistent"))
    snapshot_of(collector.collect())
    assert pynvml.nvmlLib is fake
    collector.close()
    uninstall()

    assert (pynvml.nvmlLib, pynvml.CDLL, pynvml._nvmlLib_refcount) == before
    assert "nvmlDeviceGetCount_v2" not in pynvml._nvmlGetFunctionPointer_cache
