"""The memory pre-flight: will the server have the memory to start again after a stop?

* GPU: on every GPU the server uses, NVML's free memory plus what the server itself holds
  (it gives that back when it stops) must cover its start-up budget,
  `ceil(total * gpu_memory_utilization)`, plus a margin of it.
* CPU: `MemAvailable` (/proc/meminfo) plus the server's own anonymous resident memory must
  cover its KV budget (`kv_cache_memory_bytes`) plus a margin of it plus a fixed allowance
  for weights and the runtime.

On a GPU the answer names every other process that holds device memory (pid, command line,
MiB) and says whether it is a leftover of this server (`holders`).

Missing figures make the answer unknown (`ok=None`) with the reason; the caller's setting
says whether unknown blocks the restart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvpilot.agent.model import Instance, Labels
from kvpilot.agent.remediation.holders import DeviceHolder, device_holders, holders_text
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import NvmlSnapshot
from kvpilot.collectors.procfs import (
    PROC,
    ResidentMemory,
    read_mem_available_bytes,
    read_resident_memory,
)
from kvpilot.collectors.vllm_argv import flag_value, parse_human_int

# CPU servers: weights, activations and the runtime beside the KV pool.
CPU_RUNTIME_MARGIN_BYTES = 1024**3


@dataclass(frozen=True, slots=True)
class MemoryCheck:
    """The pre-flight's answer: `ok` None means unknown, and `reason` says why."""

    device: Literal["gpu", "cpu"] | None
    ok: bool | None
    reason: str
    available_bytes: int | None = None
    required_bytes: int | None = None
    holders: tuple[DeviceHolder, ...] = ()  # other processes holding memory on the GPUs

    @property
    def own_leftovers(self) -> tuple[DeviceHolder, ...]:
        return tuple(holder for holder in self.holders if holder.own_leftover)


# -- reading figures ---------------------------------------------------------------------


def _label(cache_config: Labels | None, name: str) -> str | None:
    value = dict(cache_config or ()).get(name)
    return None if value in (None, "", "None") else value


def kv_budget_bytes(cache_config: Labels | None, argv: Sequence[str] | None) -> int | None:
    """The KV pool's size: the served config's label first, else the argv's flag."""
    for text in (
        _label(cache_config, "kv_cache_memory_bytes"),
        flag_value(argv, "--kv-cache-memory-bytes") if argv else None,
    ):
        if text is not None and (value := parse_human_int(text)) is not None:
            return value
    return None


def gpu_memory_utilization(cache_config: Labels | None, argv: Sequence[str] | None) -> float | None:
    for text in (
        _label(cache_config, "gpu_memory_utilization"),
        flag_value(argv, "--gpu-memory-utilization") if argv else None,
    ):
        if text is None:
            continue
        try:
            return float(text)
        except ValueError:
            continue
    return None


def check_gpu(
    nvml: NvmlSnapshot, cache_config: Labels | None, instance: Instance, margin_ratio: float
) -> MemoryCheck:
    """Every GPU the server's processes use must hold its budget once the server is gone."""
    utilization = gpu_memory_utilization(cache_config, instance.argv)
    if utilization is None:
        return MemoryCheck(
            "gpu", None, "gpu_memory_utilization unknown (no cache_config_info, no flag)"
        )
    gpus = [g for g in nvml.gpus if g.processes and any(p.is_server for p in g.processes)]
    if not gpus:
        return MemoryCheck("gpu", None, "the server's processes are not seen on any GPU")
    worst: MemoryCheck | None = None
    for gpu in gpus:
        own = gpu.server_used_bytes()
        if gpu.total_bytes is None or gpu.free_bytes is None or own is None:
            return MemoryCheck(
                "gpu", None, f"GPU {gpu.index}: total, free or the server's use unknown"
            )
        budget = math.ceil(gpu.total_bytes * utilization)
        required = budget + math.ceil(budget * margin_ratio)
        available = gpu.free_bytes + own
        check = MemoryCheck(
            "gpu",
            available >= required,
            f"GPU {gpu.index}: free {_gib(gpu.free_bytes)} + server's own {_gib(own)} = "
            f"{_gib(available)} {'>=' if available >= required else '<'} budget "
            f"{_gib(budget)} (utilization {utilization:g}) + {margin_ratio:.0%} margin",
            available,
            required,
        )
        if worst is None or not check.ok:
            worst = check
        if not check.ok:
            break
    assert worst is not None
    return worst


def check_cpu(
    mem_available_bytes: int | None,
    resident: ResidentMemory,
    kv_bytes: int | None,
    *,
    margin_ratio: float,
    runtime_margin_bytes: int,
) -> MemoryCheck:
    """Available RAM plus the server's own anonymous memory against its KV budget and margins."""
    if mem_available_bytes is None:
        return MemoryCheck("cpu", None, "MemAvailable unreadable from /proc/meminfo")
    if kv_bytes is None:
        return MemoryCheck(
            "cpu", None, "KV budget unknown (no kv_cache_memory_bytes label or flag)"
        )
    if resident.missing_pids:
        return MemoryCheck(
            "cpu", None, f"resident memory of PIDs {list(resident.missing_pids)} unreadable"
        )
    # Anonymous pages are what the server gives back; its file pages are page cache, which
    # MemAvailable already counts as reclaimable (VmRSS would count them twice).
    available = mem_available_bytes + resident.anon_bytes
    required = kv_bytes + math.ceil(kv_bytes * margin_ratio) + runtime_margin_bytes
    ok = available >= required
    return MemoryCheck(
        "cpu",
        ok,
        f"MemAvailable {_gib(mem_available_bytes)} + server's own {_gib(resident.anon_bytes)} "
        f"({resident.pids_read} processes) = {_gib(available)} {'>=' if ok else '<'} KV "
        f"{_gib(kv_bytes)} + {margin_ratio:.0%} + {_gib(runtime_margin_bytes)} for the runtime",
        available,
        required,
    )


def _gib(value: int) -> str:
    return f"{value / 1024**3:.2f} GiB"


class MemoryPreflight:
    """Runs the GPU or CPU check for one instance from the latest NVML snapshot and /proc."""

    def __init__(
        self,
        *,
        latest_nvml: Callable[[], NvmlSnapshot | SourceError | None],
        cache_config: Callable[[str], Labels | None],
        margin_ratio: float,
        runtime_margin_bytes: int = CPU_RUNTIME_MARGIN_BYTES,
        device: Literal["auto", "gpu", "cpu"] = "auto",
        proc_root: Path = PROC,
        server_marks: Callable[[str], frozenset[str]] = lambda name: frozenset(),
    ) -> None:
        self._latest_nvml = latest_nvml
        self._cache_config = cache_config
        self.margin_ratio = margin_ratio
        self.runtime_margin_bytes = runtime_margin_bytes
        self.device = device
        self._proc_root = proc_root
        self._server_marks = server_marks  # the runtime's marks of the instance's starts

    def check(self, instance: Instance) -> MemoryCheck:
        nvml = self._latest_nvml()
        cache_config = self._cache_config(instance.name)
        device = self.device
        if device == "auto":
            # A GPU that NVML lists means a GPU server; without NVML or GPUs it is a CPU one.
            has_gpu = isinstance(nvml, NvmlSnapshot) and bool(nvml.gpus)
            device = "gpu" if has_gpu else "cpu"
        if device == "gpu":
            if not isinstance(nvml, NvmlSnapshot):
                why = nvml.message if isinstance(nvml, SourceError) else "no NVML snapshot"
                return MemoryCheck("gpu", None, f"NVML unavailable: {why}")
            check = check_gpu(nvml, cache_config, instance, self.margin_ratio)
            holders = device_holders(
                nvml,
                instance,
                marks=self._server_marks(instance.name),
                proc_root=self._proc_root,
            )
            return dataclasses.replace(
                check, reason=check.reason + holders_text(holders), holders=holders
            )
        return check_cpu(
            read_mem_available_bytes(self._proc_root),
            read_resident_memory(instance.pids, self._proc_root),
            kv_budget_bytes(cache_config, instance.argv),
            margin_ratio=self.margin_ratio,
            runtime_margin_bytes=self.runtime_margin_bytes,
        )
