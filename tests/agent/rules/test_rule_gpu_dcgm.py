"""The NVML rules where NVML sees nothing of the server: dcgm-exporter's device memory."""

from __future__ import annotations

from kvpilot.agent.rules.config import GpuMemoryGrowthConfig, GpuNeighbourPressureConfig
from kvpilot.agent.rules.gpu_memory import GpuMemoryGrowthRule, GpuNeighbourPressureRule
from kvpilot.collectors.dcgm import DcgmGpu, DcgmSnapshot
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import GpuProcess
from tests.agent.rules.rules_helpers import GIB, Driver, annotation, gpu, label, nvml, only

MIB = 1 << 20
NO_NVML = SourceError("nvml", "unavailable", "libnvidia-ml.so.1 not found")


def device(t: float, used_bytes: int | None, *, gpus: int = 1) -> DcgmSnapshot:
    return DcgmSnapshot(
        taken_at_s=t,
        wall_time_s=t,
        pod="vllm-7c9d8b6f5-x2k4p",
        namespace="llm",
        gpus=tuple(
            DcgmGpu(
                gpu=str(i),
                uuid=f"GPU-{i}",
                mig_instance="",
                model_name="NVIDIA H100 80GB HBM3",
                hostname="gpu-node-07",
                container="vllm",
                used_bytes=used_bytes,
                free_bytes=None if used_bytes is None else 80 * GIB - used_bytes,
                reserved_bytes=0,
            )
            for i in range(gpus)
        ),
    )


def growth() -> GpuMemoryGrowthRule:
    return GpuMemoryGrowthRule(GpuMemoryGrowthConfig(window_s=1800))


def test_without_nvml_the_growth_rule_watches_the_pods_gpu_device_memory() -> None:
    driver = Driver(growth())
    out = []
    for m in range(31):
        t = 60.0 * m
        out = driver.tick(t, gpu_state=NO_NVML, dcgm=device(t, 60 * GIB + 20 * MIB * m))
    c = only(out)
    assert c.active is True
    assert label(c, "gpu") == "0"
    assert "device memory" in c.summary and "not the process" in c.summary
    assert "llm/vllm-7c9d8b6f5-x2k4p" in (annotation(c, "description") or "")


def test_flat_device_memory_does_not_fire() -> None:
    driver = Driver(growth())
    for m in range(31):
        out = driver.tick(60.0 * m, gpu_state=NO_NVML, dcgm=device(60.0 * m, 60 * GIB))
    assert only(out).active is False


def test_nvml_pids_the_pod_cannot_map_fall_back_to_dcgm() -> None:
    unmapped = GpuProcess(host_pid=4242, container_pid=None, used_bytes=60 * GIB, is_server=False)
    c = only(Driver(growth()).tick(1.0, gpu_state=nvml(1.0, gpu([unmapped])), dcgm=device(1, GIB)))
    assert c.active is None
    assert "collecting history" in (c.reason or "")  # dcgm's history, not "cannot map"


def test_pressure_says_device_memory_cannot_tell_the_server_from_neighbours() -> None:
    rule = GpuNeighbourPressureRule(GpuNeighbourPressureConfig())
    out = Driver(rule).tick(1.0, gpu_state=NO_NVML, dcgm=device(1.0, 60 * GIB, gpus=2))
    assert [label(c, "gpu") for c in out] == ["0", "1"]
    assert all(c.active is None and "device's memory" in (c.reason or "") for c in out)


def test_dcgm_failing_or_knowing_no_gpu_of_the_pod_is_unknown_with_the_reason() -> None:
    failed = SourceError("dcgm", "refused", "cannot connect to http://prometheus:9090")
    c = only(Driver(growth()).tick(1.0, gpu_state=NO_NVML, dcgm=failed))
    assert c.active is None and "cannot connect" in (c.reason or "")
    c = only(Driver(growth()).tick(1.0, gpu_state=NO_NVML, dcgm=device(1.0, GIB, gpus=0)))
    assert c.active is None and "no GPU allocated to pod llm/" in (c.reason or "")
    c = only(Driver(growth()).tick(1.0, gpu_state=NO_NVML, dcgm=device(1.0, None)))
    assert c.active is None and "DCGM_FI_DEV_FB_USED" in (c.reason or "")
