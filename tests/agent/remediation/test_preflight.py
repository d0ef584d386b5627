"""The memory pre-flight: GPU from NVML figures, CPU from /proc, unknown when figures lack."""

from __future__ import annotations

import math
import os
from pathlib import Path

from kvpilot.agent.model import labels_of
from kvpilot.agent.remediation import MemoryPreflight
from kvpilot.agent.remediation.preflight import check_gpu, kv_budget_bytes
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import GpuProcess, GpuSample, NvmlSnapshot
from kvpilot.collectors.procfs import read_mem_available_bytes, read_resident_memory
from kvpilot.collectors.vllm_argv import flag_value, parse_human_int

from .remediation_helpers import make_instance

GIB = 1024**3
MIB = 1024**2


def fake_proc(
    tmp_path: Path, *, available_kib: int | None, rss: dict[int, tuple[int, int]]
) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    lines = ["MemTotal:       24000000 kB", "MemFree:         1000000 kB"]
    if available_kib is not None:
        lines.append(f"MemAvailable:   {available_kib} kB")
    (root / "meminfo").write_text("\n".join(lines) + "\n")
    for pid, (vm_rss_kib, anon_kib) in rss.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "status").write_text(
            f"Name:\tpython\nPid:\t{pid}\nVmRSS:\t{vm_rss_kib} kB\nRssAnon:\t{anon_kib} kB\n"
            f"RssFile:\t{vm_rss_kib - anon_kib} kB\n"
        )
    return root


def gpu(total: int, free: int, server_used: int | None, neighbour_used: int = 0) -> GpuSample:
    return GpuSample(
        index=0,
        uuid="GPU-0",
        name="H100",
        total_bytes=total,
        used_bytes=total - free,
        free_bytes=free,
        reserved_bytes=None,
        utilization_gpu_ratio=None,
        utilization_memory_ratio=None,
        processes=(
            GpuProcess(100, 100, server_used, True),
            GpuProcess(999, None, neighbour_used, False),
        ),
        mig_instances=(),
    )


def snapshot(*gpus: GpuSample) -> NvmlSnapshot:
    return NvmlSnapshot(1.0, 2.0, "550", gpus)


def test_parse_human_int_matches_vllm() -> None:
    assert parse_human_int("1k") == 1000
    assert parse_human_int("1K") == 1024
    assert parse_human_int("25.6k") == 25600
    assert parse_human_int("64M") == 64 * MIB
    assert parse_human_int("1.5M") is None  # vLLM refuses decimals with binary suffixes
    assert parse_human_int("67108864") == 67108864
    assert parse_human_int("lots") is None


def test_kv_budget_from_label_then_argv() -> None:
    argv = ("vllm", "serve", "m", "--kv-cache-memory-bytes=2G")
    assert flag_value(argv, "--kv-cache-memory-bytes") == "2G"
    assert kv_budget_bytes(labels_of({"kv_cache_memory_bytes": "1000"}), argv) == 1000
    assert kv_budget_bytes(labels_of({"kv_cache_memory_bytes": "None"}), argv) == 2 * GIB
    assert kv_budget_bytes((), ("vllm", "serve", "m")) is None


def test_cpu_check_passes_and_fails_on_the_figures(tmp_path: Path) -> None:
    kv = 4 * GIB
    root = fake_proc(
        tmp_path,
        available_kib=2 * 1024 * 1024,
        rss={100: (3 * 1024 * 1024, 2_900_000), 101: (10_000, 5_000)},
    )
    inst = make_instance(pid=100)
    check = MemoryPreflight(
        latest_nvml=lambda: SourceError("nvml", "unavailable", "no driver"),
        cache_config=lambda name: labels_of({"kv_cache_memory_bytes": str(kv)}),
        margin_ratio=0.05,
        runtime_margin_bytes=512 * MIB,
        proc_root=root,
    )
    result = check.check(inst)
    available = 2 * GIB + (2_900_000 + 5_000) * 1024  # MemAvailable + anonymous RSS
    required = kv + math.ceil(kv * 0.05) + 512 * MIB
    assert result.device == "cpu"
    assert result.available_bytes == available and result.required_bytes == required
    assert result.ok is (available >= required)
    assert result.ok is True
    tight = MemoryPreflight(
        latest_nvml=lambda: None,
        cache_config=lambda name: labels_of({"kv_cache_memory_bytes": str(8 * GIB)}),
        margin_ratio=0.05,
        runtime_margin_bytes=512 * MIB,
        proc_root=root,
    ).check(inst)
    assert tight.ok is False and "<" in tight.reason


def test_cpu_check_is_unknown_without_meminfo_kv_budget_or_pids(tmp_path: Path) -> None:
    def preflight(root: Path, kv: str | None) -> MemoryPreflight:
        return MemoryPreflight(
            latest_nvml=lambda: None,
            cache_config=lambda n: None if kv is None else labels_of({"kv_cache_memory_bytes": kv}),
            margin_ratio=0.0,
            runtime_margin_bytes=0,
            proc_root=root,
        )

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    no_meminfo = fake_proc(tmp_path / "a", available_kib=None, rss={100: (1000, 500)})
    result = preflight(no_meminfo, "1").check(make_instance(pid=100))
    assert result.ok is None and "MemAvailable" in result.reason
    root = fake_proc(tmp_path / "b", available_kib=1000, rss={100: (1000, 500)})
    result = preflight(root, None).check(make_instance(pid=100))
    assert result.ok is None and "KV budget unknown" in result.reason
    result = preflight(root, "1").check(make_instance(pid=300))  # no /proc entry for 300
    assert result.ok is None and "300" in result.reason
    assert preflight(root, "1").check(make_instance(pid=100)).ok is None  # PID 101 missing


def test_gpu_check_counts_the_servers_own_memory() -> None:
    total = 80 * GIB
    budget = math.ceil(total * 0.9)
    # Neighbours hold 4 GiB: free + the server's own 70 GiB = 76 GiB >= 72 GiB budget.
    ok = check_gpu(
        snapshot(gpu(total, free=6 * GIB, server_used=70 * GIB, neighbour_used=4 * GIB)),
        labels_of({"gpu_memory_utilization": "0.9"}),
        make_instance(),
        margin_ratio=0.0,
    )
    assert ok.ok is True and ok.required_bytes == budget and ok.available_bytes == 76 * GIB
    # A neighbour with 10 GiB leaves 70 GiB: below the budget, the restart would fail.
    short = check_gpu(
        snapshot(gpu(total, free=0, server_used=70 * GIB, neighbour_used=10 * GIB)),
        labels_of({"gpu_memory_utilization": "0.9"}),
        make_instance(),
        margin_ratio=0.0,
    )
    assert short.ok is False


def test_gpu_check_unknowns() -> None:
    inst = make_instance()
    unknown_use = check_gpu(
        snapshot(gpu(80 * GIB, GIB, None)), labels_of({"gpu_memory_utilization": "0.9"}), inst, 0.0
    )
    assert unknown_use.ok is None
    no_util = check_gpu(snapshot(gpu(80 * GIB, GIB, GIB)), (), inst, 0.0)
    assert no_util.ok is None and "gpu_memory_utilization" in no_util.reason
    forced_gpu = MemoryPreflight(
        latest_nvml=lambda: SourceError("nvml", "error", "driver gone"),
        cache_config=lambda n: None,
        margin_ratio=0.0,
        runtime_margin_bytes=0,
        device="gpu",
    ).check(inst)
    assert forced_gpu.ok is None and "driver gone" in forced_gpu.reason


def test_auto_picks_gpu_when_nvml_lists_gpus() -> None:
    check = MemoryPreflight(
        latest_nvml=lambda: snapshot(gpu(80 * GIB, 10 * GIB, 60 * GIB)),
        cache_config=lambda n: labels_of({"gpu_memory_utilization": "0.5"}),
        margin_ratio=0.05,
        runtime_margin_bytes=0,
    ).check(make_instance())
    assert check.device == "gpu" and check.ok is True


def test_real_proc_figures_of_this_process() -> None:
    available = read_mem_available_bytes()
    assert available is not None and available > 0
    own = read_resident_memory([os.getpid()])
    assert own.pids_read == 1 and own.missing_pids == ()
    assert 0 < own.anon_bytes <= own.rss_bytes
