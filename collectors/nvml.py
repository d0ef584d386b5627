"""The only module that talks to NVML (``pynvml``, from the ``nvidia-ml-py`` distribution).

NVML is initialised on first use. Every call goes through :meth:`NvmlCollector._query`, whose
policy is: a failed reading becomes ``None`` with ``"<query>: <reason>"`` on the value holding it
and one count in :meth:`NvmlCollector.errors_by_reason`; errors that mean NVML itself is gone
(no library, no driver, a driver/library mismatch, lost initialisation) abort the snapshot and
make the whole source unavailable. Unavailability is logged once, returned as a
:class:`SourceError` on every ``collect()`` and retried at most every ``retry_after_s``.

The collector is not thread-safe: one caller (the agent's tick) uses it at a time.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import pynvml

from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import GpuProcess, GpuSample, MigInstance, NvmlSnapshot
from kvpilot.collectors.pidmap import PidMapper, ProcView

log = logging.getLogger(__name__)

SOURCE = "nvml"
T = TypeVar("T")

# Errors that say NVML as a whole cannot be used: the source goes unavailable.
_FATAL: tuple[type[Exception], ...] = (
    pynvml.NVMLError_Uninitialized,
    pynvml.NVMLError_LibraryNotFound,
    pynvml.NVMLError_DriverNotLoaded,
    pynvml.NVMLError_LibRmVersionMismatch,
)
# The v2 memory call is missing or refused: use v1 (without the reserved figure).
_MEMORY_V1_FALLBACK: tuple[type[Exception], ...] = (
    pynvml.NVMLError_FunctionNotFound,
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_ArgumentVersionMismatch,
)
# sizeof(nvmlMemory_v2_t) | 2 << 24, for bindings that predate the constant.
_MEMORY_V2 = getattr(pynvml, "nvmlMemory_v2", 40 | 2 << 24)
_NOT_AVAILABLE = 2**64 - 1

_WHY_UNAVAILABLE = {
    pynvml.NVMLError_LibraryNotFound: (
        "the NVML library (libnvidia-ml.so.1) was not found: no NVIDIA driver is installed or "
        "mounted into this container"
    ),
    pynvml.NVMLError_DriverNotLoaded: "the NVIDIA kernel driver is not loaded",
    pynvml.NVMLError_LibRmVersionMismatch: (
        "the NVML library and the kernel driver have different versions (reload the driver "
        "after an upgrade)"
    ),
    pynvml.NVMLError_NoPermission: "this user may not use NVML",
    pynvml.NVMLError_Uninitialized: "NVML was shut down underneath the collector",
}


def error_reason(exc: BaseException) -> str:
    """A short snake_case reason for an NVML error: ``NVMLError_GpuIsLost`` -> ``gpu_is_lost``."""
    name = type(exc).__name__
    if name.startswith("NVMLError_"):
        return re.sub(r"(?<!^)(?=[A-Z])", "_", name.removeprefix("NVMLError_")).lower()
    value = getattr(exc, "value", None)
    if isinstance(exc, pynvml.NVMLError) and isinstance(value, int):
        return f"nvml_error_{value}"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclass(frozen=True, slots=True)
class _Memory:
    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int | None


class _NvmlGone(Exception):
    """NVML became unusable in the middle of a snapshot."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class NvmlCollector:
    """Reads every GPU through NVML into an :class:`NvmlSnapshot`, or a :class:`SourceError`."""

    def __init__(
        self,
        *,
        server_pids: Callable[[], frozenset[int]] = frozenset,
        pid_mapper: PidMapper | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        retry_after_s: float = 300.0,
        warn_unavailable: bool = True,
    ) -> None:
        self._server_pids = server_pids
        self._pid_mapper = pid_mapper if pid_mapper is not None else PidMapper()
        self._clock = clock
        self._wall_clock = wall_clock
        self._retry_after_s = retry_after_s
        self._warn_unavailable = warn_unavailable  # False: the caller reports the SourceError
        self._initialized = False
        self._unavailable: SourceError | None = None
        self._retry_at_s = 0.0
        self._memory_v2 = True
        self._process_calls: list[tuple[str, Callable[[Any], list[Any]]]] = [
            ("v3", pynvml.nvmlDeviceGetComputeRunningProcesses_v3),
            ("v2", pynvml.nvmlDeviceGetComputeRunningProcesses_v2),
        ]
        self._errors: Counter[str] = Counter()

    def resting(self) -> SourceError | None:
        """While NVML is unavailable and no retry is due, the error `collect` would return;
        None when `collect` would call NVML. Lets a caller skip the worker thread."""
        if self._unavailable is not None and self._clock() < self._retry_at_s:
            return self._unavailable
        return None

    def collect(self) -> NvmlSnapshot | SourceError:
        """One snapshot of every GPU; while NVML is unavailable, the same cheap error."""
        now_s = self._clock()
        if self._unavailable is not None and now_s < self._retry_at_s:
            return self._unavailable
        if not self._initialized:
            failure = self._init()
            if failure is not None:
                return self._mark_unavailable(failure, now_s)
        try:
            snapshot = self._snapshot(now_s)
        except _NvmlGone as gone:
            self._initialized = False
            self._count("nvml", error_reason(gone.cause))
            return self._mark_unavailable(_describe(gone.cause), now_s)
        except pynvml.NVMLError as exc:
            reason = error_reason(exc)
            self._count("device_count", reason)
            return SourceError(SOURCE, "error", f"cannot list GPUs: {reason}")
        if self._unavailable is not None:
            log.info("NVML is available again")
            self._unavailable = None
        return snapshot

    def errors_by_reason(self) -> dict[str, int]:
        """Failed NVML readings so far, keyed ``"<query>:<reason>"`` (a copy)."""
        return dict(self._errors)

    def close(self) -> None:
        """Shut NVML down if this collector initialised it."""
        if not self._initialized:
            return
        self._initialized = False
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            self._count("shutdown", error_reason(exc))
            log.warning("nvmlShutdown failed: %s", exc)

    def _init(self) -> str | None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._count("init", error_reason(exc))
            return _describe(exc)
        self._initialized = True
        return None

    def _mark_unavailable(self, why: str, now_s: float) -> SourceError:
        message = f"NVML disabled, because {why}"
        changed = self._unavailable is None or self._unavailable.message != message
        if changed and self._warn_unavailable:
            log.warning("%s; retrying every %.0f s", message, self._retry_after_s)
        self._unavailable = SourceError(SOURCE, "unavailable", message)
        self._retry_at_s = now_s + self._retry_after_s
        return self._unavailable

    def _snapshot(self, now_s: float) -> NvmlSnapshot:
        try:
            count = pynvml.nvmlDeviceGetCount()
        except _FATAL as exc:
            raise _NvmlGone(exc) from exc
        errors: list[str] = []
        driver = self._query("driver_version", errors, pynvml.nvmlSystemGetDriverVersion)
        server_pids = self._server_pids()
        view = self._pid_mapper.view()
        gpus = tuple(self._gpu(index, view, server_pids) for index in range(count))
        return NvmlSnapshot(
            taken_at_s=now_s,
            wall_time_s=self._wall_clock(),
            driver_version=driver,
            gpus=gpus,
            errors=tuple(errors),
        )

    def _gpu(self, index: int, view: ProcView, server_pids: frozenset[int]) -> GpuSample:
        errors: list[str] = []
        handle = self._query("handle", errors, pynvml.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            return _unreadable_gpu(index, errors)
        memory = self._memory(handle, errors)
        utilization = self._query(
            "utilization", errors, pynvml.nvmlDeviceGetUtilizationRates, handle
        )
        return GpuSample(
            index=index,
            uuid=self._query("uuid", errors, pynvml.nvmlDeviceGetUUID, handle),
            name=self._query("name", errors, pynvml.nvmlDeviceGetName, handle),
            total_bytes=None if memory is None else memory.total_bytes,
            used_bytes=None if memory is None else memory.used_bytes,
            free_bytes=None if memory is None else memory.free_bytes,
            reserved_bytes=None if memory is None else memory.reserved_bytes,
            utilization_gpu_ratio=None if utilization is None else utilization.gpu / 100.0,
            utilization_memory_ratio=None if utilization is None else utilization.memory / 100.0,
            processes=self._processes(handle, errors, view, server_pids),
            mig_instances=self._mig_instances(index, handle, errors, view, server_pids),
            errors=tuple(errors),
        )

    def _mig_instances(
        self,
        gpu_index: int,
        handle: Any,
        errors: list[str],
        view: ProcView,
        server_pids: frozenset[int],
    ) -> tuple[MigInstance, ...]:
        # NotSupported here is an answer, not a failure: the GPU has no MIG.
        mode = self._query(
            "mig_mode",
            errors,
            pynvml.nvmlDeviceGetMigMode,
            handle,
            absent_on=(pynvml.NVMLError_NotSupported,),
        )
        if mode is None or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return ()
        count = self._query("mig_count", errors, pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)
        instances = []
        for mig_index in range(count or 0):
            mig = self._query(
                "mig_handle",
                errors,
                pynvml.nvmlDeviceGetMigDeviceHandleByIndex,
                handle,
                mig_index,
                absent_on=(pynvml.NVMLError_NotFound,),
            )
            if mig is not None:
                instances.append(self._mig(gpu_index, mig_index, mig, view, server_pids))
        return tuple(instances)

    def _mig(
        self,
        gpu_index: int,
        mig_index: int,
        mig: Any,
        view: ProcView,
        server_pids: frozenset[int],
    ) -> MigInstance:
        errors: list[str] = []
        memory = self._memory(mig, errors)
        return MigInstance(
            gpu_index=gpu_index,
            mig_index=mig_index,
            uuid=self._query("mig_uuid", errors, pynvml.nvmlDeviceGetUUID, mig),
            gpu_instance_id=self._query(
                "gpu_instance_id", errors, pynvml.nvmlDeviceGetGpuInstanceId, mig
            ),
            compute_instance_id=self._query(
                "compute_instance_id", errors, pynvml.nvmlDeviceGetComputeInstanceId, mig
            ),
            total_bytes=None if memory is None else memory.total_bytes,
            used_bytes=None if memory is None else memory.used_bytes,
            free_bytes=None if memory is None else memory.free_bytes,
            processes=self._processes(mig, errors, view, server_pids),
            errors=tuple(errors),
        )

    def _memory(self, handle: Any, errors: list[str]) -> _Memory | None:
        if self._memory_v2:
            try:
                info = self._query(
                    "memory_info_v2",
                    errors,
                    pynvml.nvmlDeviceGetMemoryInfo,
                    handle,
                    version=_MEMORY_V2,
                    raise_on=_MEMORY_V1_FALLBACK,
                )
            except pynvml.NVMLError_FunctionNotFound:
                # The driver predates the call: stop asking.
                self._memory_v2 = False
                log.info("the driver has no nvmlDeviceGetMemoryInfo_v2; reserved memory unknown")
            except _MEMORY_V1_FALLBACK:
                pass  # Refused for this device only (some MIG handles): v1 below, v2 next time.
            else:
                if info is None:
                    return None
                return _Memory(info.total, info.used, info.free, info.reserved)
        info = self._query("memory_info", errors, pynvml.nvmlDeviceGetMemoryInfo, handle)
        return None if info is None else _Memory(info.total, info.used, info.free, None)

    def _processes(
        self, handle: Any, errors: list[str], view: ProcView, server_pids: frozenset[int]
    ) -> tuple[GpuProcess, ...] | None:
        while self._process_calls:
            version, call = self._process_calls[0]
            try:
                raw = self._query(
                    f"compute_processes_{version}",
                    errors,
                    call,
                    handle,
                    raise_on=(pynvml.NVMLError_FunctionNotFound,),
                )
            except pynvml.NVMLError_FunctionNotFound:
                log.info("the driver has no compute-process call %s; trying an older one", version)
                self._process_calls.pop(0)
                continue
            if raw is None:
                return None
            return tuple(_process(item, view, server_pids) for item in raw)
        self._record("compute_processes", "function_not_found", errors)
        return None

    def _query(
        self,
        what: str,
        errors: list[str],
        fn: Callable[..., T],
        *args: Any,
        absent_on: tuple[type[Exception], ...] = (),
        raise_on: tuple[type[Exception], ...] = (),
        **kwargs: Any,
    ) -> T | None:
        """Call one NVML function: the default is ``None``; the error policy is above."""
        try:
            result = fn(*args, **kwargs)
        except absent_on:
            return None
        except raise_on:
            raise
        except _FATAL as exc:
            raise _NvmlGone(exc) from exc
        except pynvml.NVMLError as exc:
            self._record(what, error_reason(exc), errors)
            return None
        except UnicodeDecodeError:
            self._record(what, "undecodable_string", errors)
            return None
        if isinstance(result, bytes):
            # Older bindings return bytes where newer ones return str: callers get str.
            return cast(T, result.decode("utf-8", errors="replace"))
        return result

    def _record(self, what: str, reason: str, errors: list[str]) -> None:
        errors.append(f"{what}: {reason}")
        self._count(what, reason)

    def _count(self, what: str, reason: str) -> None:
        self._errors[f"{what}:{reason}"] += 1


def gpu_from_nvml(
    index: int, server_pids: frozenset[int] = frozenset()
) -> tuple[int, int, str, int] | str:
    """(total, free, name, the server's own use) of one GPU in one read, or why NVML could
    not say; the server is the process tree of `server_pids` (its use is 0 without them, or
    where NVML does not tell a process's use). A one-off read logs no "retrying" warning: it
    never retries, and its caller reports the reason."""
    collector = NvmlCollector(server_pids=lambda: server_pids, warn_unavailable=False)
    try:
        snapshot = collector.collect()
    finally:
        collector.close()
    if isinstance(snapshot, SourceError):
        return snapshot.message
    if index >= len(snapshot.gpus):
        return f"NVML sees {len(snapshot.gpus)} GPU(s); there is no GPU {index}"
    gpu = snapshot.gpus[index]
    if gpu.total_bytes is None or gpu.free_bytes is None:
        return f"GPU {index} memory unreadable: {'; '.join(gpu.errors) or 'no reason given'}"
    return gpu.total_bytes, gpu.free_bytes, gpu.name or "", gpu.server_used_bytes() or 0


def _process(item: Any, view: ProcView, server_pids: frozenset[int]) -> GpuProcess:
    used = item.usedGpuMemory
    host_pid = int(item.pid)
    return GpuProcess(
        host_pid=host_pid,
        container_pid=view.to_local(host_pid),
        used_bytes=None if used is None or used == _NOT_AVAILABLE else int(used),
        is_server=view.is_descendant_of(host_pid, server_pids),
    )


def _unreadable_gpu(index: int, errors: list[str]) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=None,
        name=None,
        total_bytes=None,
        used_bytes=None,
        free_bytes=None,
        reserved_bytes=None,
        utilization_gpu_ratio=None,
        utilization_memory_ratio=None,
        processes=None,
        mig_instances=(),
        errors=tuple(errors),
    )


def _describe(exc: Exception) -> str:
    for kind, why in _WHY_UNAVAILABLE.items():
        if isinstance(exc, kind):
            return why
    return f"nvmlInit failed: {error_reason(exc)} ({exc})"
