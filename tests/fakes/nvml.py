"""A fake of NVML's C library (libnvidia-ml.so.1), because no GPU exists where the tests run.

Only the shared library is replaced: ``install`` puts a :class:`FakeNvmlLibrary` where ``pynvml``
keeps the loaded ``CDLL`` (``pynvml.nvmlLib``), so the real ``nvmlInit``, the real symbol lookup
``_nvmlGetFunctionPointer`` (a missing symbol raises the real ``NVMLError_FunctionNotFound``), the
real wrappers, ctypes structures and ``_nvmlCheckReturn`` all run. Each fake symbol behaves like
the C function: it receives the wrapper's ctypes arguments (structures by reference, string
buffers, arrays, handles), fills them and returns an NVML return code.

GPUs are described declaratively::

    gpu = FakeGpu(uuid="GPU-0", processes=(FakeProcess(pid=4242, used_bytes=2 * GIB),))
    fake = FakeNvmlLibrary([gpu])
    uninstall = install(fake)
    ...
    uninstall()

``install(None)`` simulates a machine without the library (``CDLL`` raises ``OSError``).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

GIB = 1 << 30
_CArgObject = type(ctypes.byref(ctypes.c_int()))
_NOT_AVAILABLE = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
_NO_MIG_ID = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class FakeProcess:
    """A compute process; ``used_bytes=None`` is reported as NVML_VALUE_NOT_AVAILABLE."""

    pid: int
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class FakeMigDevice:
    """A MIG device (GPU instance + compute instance) with its own memory."""

    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    total_bytes: int
    used_bytes: int
    processes: tuple[FakeProcess, ...] = ()
    fail: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FakeGpu:
    """A GPU; memory follows v2 semantics: ``total = reserved + used + free``.

    ``mig_devices=None`` means the GPU does not support MIG; a tuple means MIG is enabled.
    ``fail`` maps a C function name to the NVML return code it returns for this device.
    """

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    total_bytes: int = 80 * GIB
    used_bytes: int = 0
    reserved_bytes: int = 512 << 20
    utilization_gpu_percent: int = 0
    utilization_memory_percent: int = 0
    processes: tuple[FakeProcess, ...] = ()
    mig_devices: tuple[FakeMigDevice, ...] | None = None
    fail: Mapping[str, int] = field(default_factory=dict)


def _deref(arg: Any) -> Any:
    """The object behind a ``byref()`` argument, as C would see through the pointer."""
    return arg._obj if isinstance(arg, _CArgObject) else arg


def _handle_value(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def _set_handle(out: Any, value: int) -> None:
    ctypes.c_void_p.from_buffer(_deref(out)).value = value


def _write_string(buffer: Any, length: Any, text: str) -> int:
    encoded = text.encode()
    if len(encoded) + 1 > _deref(length).value:
        return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    buffer.value = encoded
    return pynvml.NVML_SUCCESS


def _fill_processes(
    count_ref: Any, array: Any, processes: tuple[FakeProcess, ...], ids: tuple[int, int]
) -> int:
    count = _deref(count_ref)
    if array is None or count.value < len(processes):
        count.value = len(processes)
        return pynvml.NVML_SUCCESS if not processes else pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    for slot, process in zip(array, processes, strict=False):
        slot.pid = process.pid
        slot.usedGpuMemory = _NOT_AVAILABLE if process.used_bytes is None else process.used_bytes
        slot.gpuInstanceId, slot.computeInstanceId = ids
    count.value = len(processes)
    return pynvml.NVML_SUCCESS


class FakeNvmlLibrary:
    """Stands in for the loaded ``CDLL``: attribute lookup yields the fake C symbols.

    ``init_error`` is the return code of ``nvmlInitWithFlags`` (``None``: success);
    ``missing_functions`` are symbols this "driver" lacks; ``fail`` maps a library-wide C
    function name to a return code. All three may be changed between collections.
    """

    def __init__(
        self,
        gpus: list[FakeGpu] | tuple[FakeGpu, ...],
        *,
        driver_version: str = "550.54.15",
        init_error: int | None = None,
        missing_functions: frozenset[str] = frozenset(),
        fail: Mapping[str, int] | None = None,
    ) -> None:
        self.gpus = tuple(gpus)
        self.driver_version = driver_version
        self.init_error = init_error
        self.missing_functions = missing_functions
        self.fail = dict(fail or {})
        self.init_calls = 0
        self.calls: list[str] = []  # symbols that ran
        self.lookups: list[str] = []  # symbols pynvml asked for, found or not
        self._initialized = 0

    def __getattr__(self, name: str) -> Callable[..., int]:
        # Only called for names not found normally: the C symbol table.
        if name.startswith("_"):
            raise AttributeError(name)
        self.lookups.append(name)
        if name in self.missing_functions:
            raise AttributeError(name)
        implementation = getattr(type(self), f"_c_{name}", None)
        if implementation is None:
            raise AttributeError(name)
        bound = implementation.__get__(self)

        def symbol(*args: Any) -> int:
            self.calls.append(name)
            if name not in ("nvmlInitWithFlags", "nvmlErrorString") and not self._initialized:
                return pynvml.NVML_ERROR_UNINITIALIZED
            if name in self.fail:
                return self.fail[name]
            return bound(*args)

        symbol.__name__ = name
        return symbol

    # Devices are addressed through opaque handles; these never get dereferenced.
    def _resolve(self, handle: Any) -> tuple[FakeGpu, FakeMigDevice | None] | None:
        value = _handle_value(handle)
        if value is None or value < 0x1000:
            return None
        gpu_index, mig_slot = divmod(value - 0x1000, 0x100)
        if gpu_index >= len(self.gpus):
            return None
        gpu = self.gpus[gpu_index]
        if mig_slot == 0:
            return gpu, None
        devices = gpu.mig_devices or ()
        return (gpu, devices[mig_slot - 1]) if mig_slot <= len(devices) else None

    def _device_call(
        self, name: str, handle: Any, action: Callable[[FakeGpu, FakeMigDevice | None], int]
    ) -> int:
        resolved = self._resolve(handle)
        if resolved is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        gpu, mig = resolved
        failures = gpu.fail if mig is None else mig.fail
        if name in failures:
            return failures[name]
        return action(gpu, mig)

    def _c_nvmlInitWithFlags(self, flags: int) -> int:
        self.init_calls += 1
        if self.init_error is not None:
            return self.init_error
        self._initialized += 1
        return pynvml.NVML_SUCCESS

    def _c_nvmlShutdown(self) -> int:
        self._initialized -= 1
        return pynvml.NVML_SUCCESS

    def _c_nvmlErrorString(self, code: int) -> bytes:
        return f"fake NVML error {code}".encode()

    def _c_nvmlSystemGetDriverVersion(self, buffer: Any, length: Any) -> int:
        return _write_string(buffer, length, self.driver_version)

    def _c_nvmlDeviceGetCount_v2(self, count: Any) -> int:
        _deref(count).value = len(self.gpus)
        return pynvml.NVML_SUCCESS

    def _c_nvmlDeviceGetHandleByIndex_v2(self, index: Any, out: Any) -> int:
        position = _deref(index).value
        if position >= len(self.gpus):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        failure = self.gpus[position].fail.get("nvmlDeviceGetHandleByIndex_v2")
        if failure is not None:
            return failure
        _set_handle(out, 0x1000 + position * 0x100)
        return pynvml.NVML_SUCCESS

    def _c_nvmlDeviceGetName(self, handle: Any, buffer: Any, length: Any) -> int:
        return self._device_call(
            "nvmlDeviceGetName",
            handle,
            lambda gpu, mig: _write_string(
                buffer, length, gpu.name if mig is None else f"MIG {gpu.name}"
            ),
        )

    def _c_nvmlDeviceGetUUID(self, handle: Any, buffer: Any, length: Any) -> int:
        return self._device_call(
            "nvmlDeviceGetUUID",
            handle,
            lambda gpu, mig: _write_string(buffer, length, gpu.uuid if mig is None else mig.uuid),
        )

    def _c_nvmlDeviceGetMemoryInfo(self, handle: Any, ref: Any) -> int:
        def fill(gpu: FakeGpu, mig: FakeMigDevice | None) -> int:
            memory = _deref(ref)
            if not isinstance(memory, pynvml.c_nvmlMemory_t):
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            if mig is None:
                # v1 has no reserved field: the driver's reserve shows up as used.
                memory.total = gpu.total_bytes
                memory.used = gpu.used_bytes + gpu.reserved_bytes
            else:
                memory.total, memory.used = mig.total_bytes, mig.used_bytes
            memory.free = memory.total - memory.used
            return pynvml.NVML_SUCCESS

        return self._device_call("nvmlDeviceGetMemoryInfo", handle, fill)

    def _c_nvmlDeviceGetMemoryInfo_v2(self, handle: Any, ref: Any) -> int:
        def fill(gpu: FakeGpu, mig: FakeMigDevice | None) -> int:
            memory = _deref(ref)
            if not isinstance(memory, pynvml.c_nvmlMemory_v2_t):
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            if memory.version != pynvml.nvmlMemory_v2:
                return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            if mig is None:
                memory.total, memory.used = gpu.total_bytes, gpu.used_bytes
                memory.reserved = gpu.reserved_bytes
            else:
                memory.total, memory.used, memory.reserved = mig.total_bytes, mig.used_bytes, 0
            memory.free = memory.total - memory.reserved - memory.used
            return pynvml.NVML_SUCCESS

        return self._device_call("nvmlDeviceGetMemoryInfo_v2", handle, fill)

    def _c_nvmlDeviceGetUtilizationRates(self, handle: Any, ref: Any) -> int:
        def fill(gpu: FakeGpu, mig: FakeMigDevice | None) -> int:
            if mig is not None or gpu.mig_devices is not None:
                return pynvml.NVML_ERROR_NOT_SUPPORTED  # as real drivers do in MIG mode
            utilization = _deref(ref)
            utilization.gpu = gpu.utilization_gpu_percent
            utilization.memory = gpu.utilization_memory_percent
            return pynvml.NVML_SUCCESS

        return self._device_call("nvmlDeviceGetUtilizationRates", handle, fill)

    def _compute_processes(self, name: str, handle: Any, count: Any, array: Any) -> int:
        def fill(gpu: FakeGpu, mig: FakeMigDevice | None) -> int:
            if mig is not None:
                ids = (mig.gpu_instance_id, mig.compute_instance_id)
                return _fill_processes(count, array, mig.processes, ids)
            return _fill_processes(count, array, gpu.processes, (_NO_MIG_ID, _NO_MIG_ID))

        return self._device_call(name, handle, fill)

    def _c_nvmlDeviceGetComputeRunningProcesses_v3(
        self, handle: Any, count: Any, array: Any
    ) -> int:
        return self._compute_processes(
            "nvmlDeviceGetComputeRunningProcesses_v3", handle, count, array
        )

    def _c_nvmlDeviceGetComputeRunningProcesses_v2(
        self, handle: Any, count: Any, array: Any
    ) -> int:
        return self._compute_processes(
            "nvmlDeviceGetComputeRunningProcesses_v2", handle, count, array
        )

    def _c_nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        def fill(gpu: FakeGpu, mig: FakeMigDevice | None) -> int:
            if gpu.mig_devices is None or mig is not None:
                return pynvml.NVML_ERROR_NOT_SUPPORTED
            _deref(current).value = _deref(pending).value = pynvml.NVML_DEVICE_MIG_ENABLE
            return pynvml.NVML_SUCCESS

        return self._device_call("nvmlDeviceGetMigMode", handle, fill)

    def _c_nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, count: Any) -> int:
        def fill(gpu: FakeGpu, mig: FakeMigDevice | None) -> int:
            # Real GPUs have more slots than configured instances; empty slots are NotFound.
            _deref(count).value = len(gpu.mig_devices or ()) + 1
            return pynvml.NVML_SUCCESS

        return self._device_call("nvmlDeviceGetMaxMigDeviceCount", handle, fill)

    def _c_nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: Any, out: Any) -> int:
        def fill(gpu: FakeGpu, mig: FakeMigDevice | None) -> int:
            slot = _deref(index).value
            if mig is not None:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            if slot >= len(gpu.mig_devices or ()):
                return pynvml.NVML_ERROR_NOT_FOUND
            _set_handle(out, _handle_value(handle) + 1 + slot)
            return pynvml.NVML_SUCCESS

        return self._device_call("nvmlDeviceGetMigDeviceHandleByIndex", handle, fill)

    def _c_nvmlDeviceGetGpuInstanceId(self, handle: Any, out: Any) -> int:
        return self._mig_id("nvmlDeviceGetGpuInstanceId", handle, out, compute=False)

    def _c_nvmlDeviceGetComputeInstanceId(self, handle: Any, out: Any) -> int:
        return self._mig_id("nvmlDeviceGetComputeInstanceId", handle, out, compute=True)

    def _mig_id(self, name: str, handle: Any, out: Any, *, compute: bool) -> int:
        def fill(gpu: FakeGpu, mig: FakeMigDevice | None) -> int:
            if mig is None:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            _deref(out).value = mig.compute_instance_id if compute else mig.gpu_instance_id
            return pynvml.NVML_SUCCESS

        return self._device_call(name, handle, fill)


@dataclass(slots=True)
class _Saved:
    lib: Any
    cache: dict[str, Any]
    refcount: int
    cdll: Any


def install(fake: FakeNvmlLibrary | None) -> Callable[[], None]:
    """Make ``pynvml`` use ``fake`` (or find no library at all); returns the uninstaller."""
    saved = _Saved(
        lib=pynvml.nvmlLib,
        cache=dict(pynvml._nvmlGetFunctionPointer_cache),
        refcount=pynvml._nvmlLib_refcount,
        cdll=pynvml.CDLL,
    )
    pynvml._nvmlGetFunctionPointer_cache.clear()
    pynvml._nvmlLib_refcount = 0
    pynvml.nvmlLib = fake
    if fake is None:
        pynvml.CDLL = _no_library

    def uninstall() -> None:
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlGetFunctionPointer_cache.update(saved.cache)
        pynvml._nvmlLib_refcount = saved.refcount
        pynvml.nvmlLib = saved.lib
        pynvml.CDLL = saved.cdll

    return uninstall


@contextmanager
def installed(fake: FakeNvmlLibrary | None) -> Iterator[FakeNvmlLibrary | None]:
    """``install`` for the length of a ``with`` block."""
    uninstall = install(fake)
    try:
        yield fake
    finally:
        uninstall()


def _no_library(name: str, *args: Any, **kwargs: Any) -> Any:
    raise OSError(f"{name}: cannot open shared object file: No such file or directory")


# A hand-written /proc for the PID mapping: NVML reports host PIDs, the collector maps them.
OUR_NAMESPACE = "pid:[4026532500]"
OTHER_NAMESPACE = "pid:[4026532999]"


@dataclass(frozen=True, slots=True)
class FakeProcEntry:
    """One ``/proc/<host_pid>``: its ``NSpid`` chain (host first), parent and PID namespace."""

    ns_pids: tuple[int, ...]
    parent_pid: int = 1
    namespace: str | None = OUR_NAMESPACE  # None: the ns link is unreadable


def write_proc(root: Path, entries: list[FakeProcEntry], *, own: FakeProcEntry) -> Path:
    """Write status files and ns links under ``root``; ``self`` links to ``own``'s directory."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in (*entries, own):
        directory = root / str(entry.ns_pids[0])
        directory.mkdir(exist_ok=True)
        chain = "\t".join(str(pid) for pid in entry.ns_pids)
        (directory / "status").write_text(
            f"Name:\tpython3\nState:\tS (sleeping)\nTgid:\t{entry.ns_pids[0]}\n"
            f"Pid:\t{entry.ns_pids[0]}\nPPid:\t{entry.parent_pid}\nNStgid:\t{chain}\n"
            f"NSpid:\t{chain}\nNSpgid:\t{chain}\n"
        )
        if entry.namespace is not None:
            (directory / "ns").mkdir(exist_ok=True)
            os.symlink(entry.namespace, directory / "ns" / "pid")
    os.symlink(str(own.ns_pids[0]), root / "self")
    return root
