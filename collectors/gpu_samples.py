"""Values the NVML collector returns: one snapshot of every GPU, its MIG instances and processes.

Missing readings are ``None``; the reason sits in the ``errors`` of the value that holds them,
as ``"<query>: <reason>"`` strings (for example ``"utilization: not_supported"``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One compute process on a GPU or MIG instance.

    ``container_pid`` is the PID in the collector's own PID namespace, ``None`` when the process
    is not visible there. ``used_bytes`` is ``None`` when NVML reports NVML_VALUE_NOT_AVAILABLE
    (MIG instances and some drivers do). ``is_server`` is true when the process is one of the
    vLLM server's processes or a descendant of one.
    """

    host_pid: int
    container_pid: int | None
    used_bytes: int | None
    is_server: bool


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One MIG device of a GPU with its own memory and processes."""

    gpu_index: int
    mig_index: int
    uuid: str | None
    gpu_instance_id: int | None
    compute_instance_id: int | None
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    processes: tuple[GpuProcess, ...] | None
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One physical GPU.

    ``reserved_bytes`` comes only from NVML's v2 memory call (memory the driver and firmware keep);
    with the v1 call it is ``None`` and ``used_bytes`` includes that reserve. ``processes`` is
    ``None`` when the process list could not be read (an empty tuple means no processes).
    """

    index: int
    uuid: str | None
    name: str | None
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    reserved_bytes: int | None
    utilization_gpu_ratio: float | None
    utilization_memory_ratio: float | None
    processes: tuple[GpuProcess, ...] | None
    mig_instances: tuple[MigInstance, ...]
    errors: tuple[str, ...] = ()

    def server_used_bytes(self) -> int | None:
        """Memory used by the server's processes; ``None`` when any of them is unknown."""
        return _sum_used(self.processes, server=True)

    def neighbour_used_bytes(self) -> int | None:
        """Memory used by other processes; ``None`` when any of them is unknown."""
        return _sum_used(self.processes, server=False)


@dataclass(frozen=True, slots=True)
class NvmlSnapshot:
    """Every GPU at one moment: ``taken_at_s`` is monotonic, ``wall_time_s`` is for display."""

    taken_at_s: float
    wall_time_s: float
    driver_version: str | None
    gpus: tuple[GpuSample, ...]
    errors: tuple[str, ...] = ()


def _sum_used(processes: tuple[GpuProcess, ...] | None, *, server: bool) -> int | None:
    if processes is None:
        return None
    total = 0
    for process in processes:
        if process.is_server != server:
            continue
        if process.used_bytes is None:
            return None
        total += process.used_bytes
    return total
