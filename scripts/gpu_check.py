"""Check kvpilot's GPU paths on a real GPU: the NVML collector, the CUDA allocator reader and
the memory ledger.

Needs an NVIDIA driver and torch built with CUDA; no vLLM. Runs in well under five minutes:

    python scripts/gpu_check.py --out /tmp/gpu-check

It prints one PASS/FAIL/SKIP line per check, writes what torch's allocator reported
(``memory_stats()`` and ``memory_snapshot()`` at each stage) and the NVML snapshot as JSON
under ``--out`` for use as test fixtures, and exits 1 when any check fails (2 when there is
no GPU to check).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
# Caching-allocator geometry: requests between 1 and 10 MiB share 20 MiB segments.
HOLE_BLOCK_BYTES = 4 * MIB
HOLE_BLOCKS = 40


@dataclass(frozen=True, slots=True)
class Check:
    """The outcome of one check; ``status`` is PASS, FAIL or SKIP."""

    name: str
    status: str
    detail: str


class Report:
    """Collects and prints checks as they happen."""

    def __init__(self) -> None:
        self.checks: list[Check] = []

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self._add(Check(name, "PASS" if ok else "FAIL", detail))
        return ok

    def skip(self, name: str, detail: str) -> None:
        self._add(Check(name, "SKIP", detail))

    def failed(self) -> bool:
        return any(check.status == "FAIL" for check in self.checks)

    def _add(self, check: Check) -> None:
        self.checks.append(check)
        print(f"{check.status} {check.name}: {check.detail}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON records")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    parser.add_argument(
        "--proc-root",
        type=Path,
        default=Path("/proc"),
        help="a /proc that shows host PIDs (in a container: the host's /proc, mounted)",
    )
    parser.add_argument(
        "--alloc-gib", type=float, default=1.0, help="GiB to allocate for the NVML check"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch  # late: --help works without CUDA

    report = Report()
    if not torch.cuda.is_available():
        report.check("cuda", False, f"torch {torch.__version__} sees no CUDA device")
        return 2
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        report.skip("allocator layout", "expandable segments are on; hole sizes will differ")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.set_device(args.device)
    started_s = time.monotonic()
    check_nvml(torch, args, report)
    check_allocator(torch, args, report)
    check_ledger(torch, args, report)
    write_json(args.out / "checks.json", [dataclasses.asdict(c) for c in report.checks])
    print(f"{'FAIL' if report.failed() else 'PASS'} all: {time.monotonic() - started_s:.1f} s")
    return 1 if report.failed() else 0


def check_nvml(torch: Any, args: argparse.Namespace, report: Report) -> None:
    """NVML totals against cudaMemGetInfo, and our own process with a plausible figure."""
    from kvpilot.collectors.errors import SourceError
    from kvpilot.collectors.nvml import NvmlCollector
    from kvpilot.collectors.pidmap import PidMapper

    device = args.device
    alloc_bytes = int(args.alloc_gib * GIB)
    mapper = PidMapper(args.proc_root)
    unmapped = mapper.view().unmapped_reason
    if unmapped is not None:
        report.skip("pid mapping", f"{unmapped}; our process is matched by host PID only")
    collector = NvmlCollector(server_pids=lambda: frozenset({os.getpid()}), pid_mapper=mapper)
    try:
        held = torch.empty(alloc_bytes, dtype=torch.uint8, device=f"cuda:{device}")
        held.fill_(1)
        torch.cuda.synchronize(device)
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        snapshot = collector.collect()
        if not report.check(
            "nvml collect", not isinstance(snapshot, SourceError), str(snapshot)[:300]
        ):
            return
        write_json(args.out / "nvml_snapshot.json", dataclasses.asdict(snapshot))
        report.check(
            "nvml errors",
            not collector.errors_by_reason(),
            f"driver {snapshot.driver_version}, errors {collector.errors_by_reason()}",
        )
        memory, processes, is_mig = find_device(torch, device, snapshot)
        if memory is None:
            report.check("nvml device", False, "no NVML GPU or MIG instance matches torch's UUID")
            return
        report.check("nvml device", True, f"{memory.uuid} (MIG: {is_mig})")
        check_totals(report, memory, total_bytes, free_bytes)
        check_own_process(report, processes, alloc_bytes, is_mig, torch)
        more = torch.empty(alloc_bytes, dtype=torch.uint8, device=f"cuda:{device}")
        more.fill_(1)
        torch.cuda.synchronize(device)
        check_growth(report, collector, torch, device, processes, alloc_bytes)
        del held, more
    finally:
        collector.close()
        torch.cuda.empty_cache()


def find_device(torch: Any, device: int, snapshot: Any) -> tuple[Any, Any, bool]:
    """The NVML GPU or MIG instance torch's device is, with its process list."""
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
    bare = uuid.removeprefix("GPU-").removeprefix("MIG-")
    for gpu in snapshot.gpus:
        for mig in gpu.mig_instances:
            if bare and (mig.uuid or "").endswith(bare):
                return mig, mig.processes, True
        if bare and (gpu.uuid or "").removeprefix("GPU-") == bare:
            return gpu, gpu.processes, False
    if len(snapshot.gpus) == 1 and not bare:
        return snapshot.gpus[0], snapshot.gpus[0].processes, False
    return None, None, False


def check_totals(report: Report, memory: Any, total_bytes: int, free_bytes: int) -> None:
    # CUDA and NVML count the same memory; allow 2 % for the driver's own bookkeeping.
    tolerance = total_bytes // 50
    if memory.total_bytes is None or memory.free_bytes is None:
        report.check("nvml totals", False, f"memory unknown: {memory.errors}")
        return
    report.check(
        "nvml total vs cudaMemGetInfo",
        abs(memory.total_bytes - total_bytes) <= tolerance,
        f"nvml {memory.total_bytes} B, cuda {total_bytes} B, "
        f"diff {memory.total_bytes - total_bytes} B, reserved {memory_reserved(memory)}",
    )
    report.check(
        "nvml free vs cudaMemGetInfo",
        abs(memory.free_bytes - free_bytes) <= tolerance,
        f"nvml {memory.free_bytes} B, cuda {free_bytes} B, diff {memory.free_bytes - free_bytes} B",
    )


def memory_reserved(memory: Any) -> str:
    reserved = getattr(memory, "reserved_bytes", None)
    return "unknown (v1 memory call or MIG)" if reserved is None else f"{reserved} B"


def own_process(processes: Any) -> Any:
    pid = os.getpid()
    for process in processes or ():
        if pid in (process.host_pid, process.container_pid):
            return process
    return None


def check_own_process(
    report: Report, processes: Any, alloc_bytes: int, is_mig: bool, torch: Any
) -> None:
    ours = own_process(processes)
    listed = [(p.host_pid, p.container_pid, p.used_bytes) for p in processes or ()]
    if not report.check("nvml lists our process", ours is not None, f"pid {os.getpid()}, {listed}"):
        return
    report.check("our process is the server", ours.is_server, str(ours))
    if ours.used_bytes is None:
        if is_mig:
            report.skip("our process's memory", "NVML gives no per-process memory under MIG")
        else:
            report.check("our process's memory", False, "NVML_VALUE_NOT_AVAILABLE off MIG")
        return
    # Our tensors plus the CUDA context (a few hundred MiB), never less than what we hold.
    ceiling = torch.cuda.memory_reserved() + 4 * GIB
    report.check(
        "our process's memory",
        alloc_bytes <= ours.used_bytes <= ceiling,
        f"{ours.used_bytes} B used, {alloc_bytes} B allocated, torch reserved "
        f"{torch.cuda.memory_reserved()} B",
    )


def check_growth(
    report: Report,
    collector: Any,
    torch: Any,
    device: int,
    before: Any,
    alloc_bytes: int,
) -> None:
    first = own_process(before)
    again = collector.collect()
    _, processes, _ = find_device(torch, device, again)
    second = own_process(processes)
    if first is None or second is None or first.used_bytes is None or second.used_bytes is None:
        report.skip("our process's growth", "no per-process figure to compare")
        return
    grown = second.used_bytes - first.used_bytes
    report.check(
        "our process's growth",
        alloc_bytes * 0.9 <= grown <= alloc_bytes + 256 * MIB,
        f"grew {grown} B after allocating {alloc_bytes} B more",
    )


def check_allocator(torch: Any, args: argparse.Namespace, report: Report) -> None:
    """Holes inside reserved segments give fragmentation above 0; a compact pool gives 0."""
    from kvpilot.collectors.kvpool.allocator import read_allocator_stats

    device = args.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()

    def read(stage: str) -> Any:
        torch.cuda.synchronize(device)
        stats = read_allocator_stats(device, clock=time.monotonic, wall_clock=time.time)
        record_allocator(torch, device, args.out / stage)
        consistent(report, stage, stats, torch.cuda.memory_stats(device))
        return stats

    blocks = [
        torch.empty(HOLE_BLOCK_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
        for _ in range(HOLE_BLOCKS)
    ]
    del blocks[::2]  # every other block: holes between live neighbours
    holes = read("holes")
    ratio = fragmentation_ratio(holes)
    report.check(
        "holes: fragmentation above 0",
        ratio is not None and ratio > 0,
        f"ratio {ratio}, free {holes.free_in_reserved_bytes} B, "
        f"largest {holes.largest_free_block_bytes} B",
    )
    report.check(
        "holes: inactive split bytes",
        (holes.inactive_split_bytes or 0) > 0,
        f"{holes.inactive_split_bytes} B",
    )
    blocks.clear()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    emptied = read("emptied")
    report.check(
        "emptied: nothing reserved",
        emptied.reserved_bytes == 0 and fragmentation_ratio(emptied) is None,
        f"reserved {emptied.reserved_bytes} B, ratio {fragmentation_ratio(emptied)}",
    )
    fresh = torch.empty(HOLE_BLOCK_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
    compact = read("compact")
    report.check(
        "compact: fragmentation 0",
        fragmentation_ratio(compact) == 0.0
        and compact.largest_free_block_bytes == compact.free_in_reserved_bytes,
        f"ratio {fragmentation_ratio(compact)}, free {compact.free_in_reserved_bytes} B",
    )
    del fresh
    torch.cuda.empty_cache()


def fragmentation_ratio(stats: Any) -> float | None:
    if hasattr(stats, "fragmentation_ratio"):
        return stats.fragmentation_ratio
    return stats.fragmentation.ratio


def consistent(report: Report, stage: str, stats: Any, raw: dict[str, Any]) -> None:
    """The reader's figures agree with torch's own counters and with each other."""
    reserved = raw.get("reserved_bytes.all.current")
    allocated = raw.get("allocated_bytes.all.current")
    checks: list[tuple[str, Callable[[], bool], str]] = [
        (
            "reserved",
            lambda: stats.reserved_bytes == reserved,
            f"{stats.reserved_bytes} vs {reserved}",
        ),
        (
            "allocated",
            lambda: stats.allocated_bytes == allocated,
            f"{stats.allocated_bytes} vs {allocated}",
        ),
        (
            "free in reserved = reserved - allocated",
            lambda: stats.free_in_reserved_bytes == (reserved or 0) - (allocated or 0),
            f"{stats.free_in_reserved_bytes} vs {(reserved or 0) - (allocated or 0)}",
        ),
        (
            "largest free block <= free in reserved",
            lambda: 0 <= stats.largest_free_block_bytes <= stats.free_in_reserved_bytes,
            f"{stats.largest_free_block_bytes} <= {stats.free_in_reserved_bytes}",
        ),
    ]
    ratio = fragmentation_ratio(stats)
    if stats.free_in_reserved_bytes > 0:
        expected = 1 - stats.largest_free_block_bytes / stats.free_in_reserved_bytes
        checks.append(
            (
                "ratio formula",
                lambda: ratio is not None and abs(ratio - expected) < 1e-9,
                f"{ratio}",
            )
        )
    for name, ok, detail in checks:
        report.check(f"{stage}: {name}", ok(), detail)


# The ledger's goal: what no part names stays within this share of the device.
UNATTRIBUTED_GOAL_RATIO = 0.01


def check_ledger(torch: Any, args: argparse.Namespace, report: Report) -> None:
    """The memory ledger of a stand-in worker (weights measured as vLLM measures them, a KV
    cache, the CUDA context as vLLM's start-up snapshot takes it): unattributed memory, the
    used memory minus the parts, stays within 1 % of the device."""
    from types import SimpleNamespace

    from kvpilot.collectors.kvpool.ledger_reader import read_cuda_ledger

    device = args.device
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    # vLLM's MemorySnapshot: the device's used memory minus what torch reserved.
    context = (total - free) - torch.cuda.memory_reserved(device)
    before = torch.cuda.mem_get_info(device)[0]
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).to(device)
    weights = before - torch.cuda.mem_get_info(device)[0]  # as vLLM's model_memory_usage
    kv = torch.zeros(256 * MIB, dtype=torch.int8, device=device)
    scratch = [torch.empty(3 * MIB, dtype=torch.int8, device=device) for _ in range(8)]
    del scratch[::2]  # freed blocks the allocator keeps: slack
    worker = SimpleNamespace(
        model_runner=SimpleNamespace(model=model, kv_caches=[kv], model_memory_usage=weights),
        init_snapshot=SimpleNamespace(non_torch_memory=context),
        requested_memory=None,
    )
    torch.cuda.synchronize(device)
    ledger = read_cuda_ledger(worker, device=device, rank="0", blocks=None)
    unattributed = ledger.unattributed_bytes
    parts = ", ".join(f"{p.name} {p.size_bytes / MIB:.1f} MiB ({p.source})" for p in ledger.parts)
    print(f"ledger: {parts}; used {(ledger.used_bytes or 0) / MIB:.1f} MiB")
    write_json(args.out / "ledger.json", dataclasses.asdict(ledger))
    if unattributed is None:
        report.check("ledger: unattributed", False, "the ledger has no used memory")
        return
    share = abs(unattributed) / total
    report.check(
        "ledger: unattributed within 1 % of the device",
        share <= UNATTRIBUTED_GOAL_RATIO,
        f"{unattributed / MIB:.1f} MiB = {share:.2%} of {total / MIB:.0f} MiB "
        "(other processes on the device count here too)",
    )
    del model, kv, scratch


def record_allocator(torch: Any, device: int, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / "memory_stats.json", dict(torch.cuda.memory_stats(device)))
    try:
        snapshot = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:
        snapshot = torch.cuda.memory_snapshot()
    write_json(directory / "memory_snapshot.json", snapshot)


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
