"""The pre-flight names who holds device memory, through the real pynvml on the NVML fake
(an agent on the host: its /proc shows host PIDs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.agent.model import Instance
from kvpilot.agent.remediation import MemoryPreflight
from kvpilot.agent.runtimes.processes import SERVER_MARK_ENV
from kvpilot.collectors.nvml import NvmlCollector
from kvpilot.collectors.pidmap import ROOT_PID_NAMESPACE, PidMapper
from tests.fakes.nvml import (
    FakeGpu,
    FakeNvmlLibrary,
    FakeProcEntry,
    FakeProcess,
    install,
    write_proc,
)

GIB = 1 << 30
MIB = 1 << 20
SERVER_ARGV = ("python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m")
API, ORPHAN_ENGINE, TRAINER, SIDECAR = 6001, 6002, 7001, 5000


def add_process(
    root: Path, pid: int, ppid: int, argv: tuple[str, ...], env: dict[str, str]
) -> None:
    """The files `read_proc` and `read_environ` read, in the kernel's formats."""
    rest = " ".join(["0"] * 16)
    (root / str(pid) / "stat").write_text(f"{pid} (python3) S {ppid} {pid} {rest} 1000 0 0\n")
    (root / str(pid) / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
    (root / str(pid) / "environ").write_bytes(
        b"".join(f"{k}={v}\0".encode() for k, v in env.items())
    )


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    root = write_proc(
        tmp_path / "proc",
        [
            FakeProcEntry(ns_pids=(API,), parent_pid=1, namespace=ROOT_PID_NAMESPACE),
            FakeProcEntry(
                ns_pids=(ORPHAN_ENGINE,), parent_pid=1, namespace=ROOT_PID_NAMESPACE
            ),  # outlived its API server
            FakeProcEntry(ns_pids=(TRAINER,), parent_pid=1, namespace=ROOT_PID_NAMESPACE),
        ],
        own=FakeProcEntry(ns_pids=(SIDECAR,), namespace=ROOT_PID_NAMESPACE),
    )
    add_process(root, API, 1, SERVER_ARGV, {SERVER_MARK_ENV: "start-2"})
    add_process(root, ORPHAN_ENGINE, 1, ("VLLM::EngineCore",), {SERVER_MARK_ENV: "start-1"})
    add_process(root, TRAINER, 1, ("python", "train.py", "--hf-token=hf_abcdefghijklmnopqrstu"), {})
    return root


@pytest.fixture
def nvml() -> Iterator[None]:
    gpu = FakeGpu(
        uuid="GPU-0",
        total_bytes=80 * GIB,
        used_bytes=76 * GIB,
        processes=(
            FakeProcess(pid=API, used_bytes=1 * GIB),
            FakeProcess(pid=ORPHAN_ENGINE, used_bytes=70 * GIB),
            FakeProcess(pid=TRAINER, used_bytes=5 * GIB),
        ),
    )
    uninstall = install(FakeNvmlLibrary([gpu]))
    yield
    uninstall()


def instance(pids: frozenset[int]) -> Instance:
    return Instance(
        name="vllm-0",
        role="stable",
        url="http://127.0.0.1:8000",
        kvpool_url=None,
        pids=pids,
        main_pid=min(pids) if pids else None,
        argv=SERVER_ARGV,
        started_at_wall_s=None,
    )


def preflight(proc_root: Path, pids: frozenset[int], marks: frozenset[str]) -> MemoryPreflight:
    collector = NvmlCollector(server_pids=lambda: pids, pid_mapper=PidMapper(proc_root))
    return MemoryPreflight(
        latest_nvml=collector.collect,
        cache_config=lambda name: (("gpu_memory_utilization", "0.9"),),
        margin_ratio=0.05,
        proc_root=proc_root,
        server_marks=lambda name: marks,
    )


@pytest.mark.usefixtures("nvml")
def test_an_orphaned_engine_of_this_server_is_named_as_its_leftover(proc_root: Path) -> None:
    # The API server runs (start 2); the engine of start 1 survived and holds 70 GiB.
    check = preflight(proc_root, frozenset({API}), frozenset({"start-1"})).check(
        instance(frozenset({API}))
    )
    assert check.ok is False
    assert [(h.pid, h.used_bytes, h.own_leftover) for h in check.holders] == [
        (ORPHAN_ENGINE, 70 * GIB, True),
        (TRAINER, 5 * GIB, False),
    ]
    assert f"pid {ORPHAN_ENGINE} (VLLM::EngineCore) holds 71680 MiB on GPU 0, a leftover" in (
        check.reason
    )
    assert f"pid {TRAINER} (python train.py" in check.reason
    assert "hf_abcdefghijklmnopqrstu" not in check.reason  # a secret on a command line is masked


@pytest.mark.usefixtures("nvml")
def test_a_neighbour_is_not_a_leftover_without_the_mark(proc_root: Path) -> None:
    # Without the runtime's record of start 1, the orphan carries no mark this server knows.
    check = preflight(proc_root, frozenset({API}), frozenset()).check(instance(frozenset({API})))
    assert [h.own_leftover for h in check.holders] == [False, False]
    assert "a leftover" not in check.reason
