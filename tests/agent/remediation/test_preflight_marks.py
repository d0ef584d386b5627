"""The local runtime remembers the mark of every start of a server, so the pre-flight names a
process that carries an earlier start's mark (an engine that outlived its API server) as this
server's leftover. The starts are real processes: a file named `vllm` run as
`python DIR/vllm serve m --port P`, which writes the mark it was given and exits."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from kvpilot.agent.remediation import MemoryPreflight
from kvpilot.agent.runtimes import LocalRuntime
from kvpilot.agent.runtimes.local import LocalInstanceSpec
from kvpilot.agent.runtimes.probe import StartFailed
from kvpilot.agent.runtimes.processes import SERVER_MARK_ENV
from kvpilot.collectors.nvml import NvmlCollector
from kvpilot.collectors.pidmap import ROOT_PID_NAMESPACE, PidMapper
from kvpilot.rig.server import free_port
from tests.agent.remediation.test_preflight_holders import (
    API,
    GIB,
    ORPHAN_ENGINE,
    SERVER_ARGV,
    SIDECAR,
    TRAINER,
    add_process,
    instance,
    nvml,  # noqa: F401 (the NVML fake: the API server, an orphaned engine, a trainer)
)
from tests.fakes.nvml import FakeProcEntry, write_proc


def started_marks(tmp_path: Path, starts: int) -> tuple[LocalRuntime, list[str]]:
    """A local runtime that started its server `starts` times, and the marks each start got."""
    program, seen = tmp_path / "vllm", tmp_path / "marks"
    program.write_text(
        f"import os, sys\nopen({str(seen)!r}, 'a').write(os.environ[{SERVER_MARK_ENV!r}] + '\\n')\n"
        "sys.exit(3)\n"
    )
    argv = (sys.executable, str(program), "serve", "m", "--port", str(free_port()))
    runtime = LocalRuntime([LocalInstanceSpec("vllm-0", argv)], tmp_path / "logs")
    for _ in range(starts):
        with pytest.raises(StartFailed):
            asyncio.run(runtime.start("vllm-0", ready_timeout_s=30))
    return runtime, seen.read_text().split()


@pytest.mark.usefixtures("nvml")
def test_an_engine_of_an_earlier_start_is_named_this_servers_leftover(tmp_path: Path) -> None:
    runtime, marks = started_marks(tmp_path, starts=3)
    assert len(set(marks)) == 3
    assert runtime.server_marks("vllm-0") == frozenset(marks)
    assert runtime.server_marks("another") == frozenset()
    root = write_proc(
        tmp_path / "proc",
        [
            FakeProcEntry(ns_pids=(pid,), parent_pid=1, namespace=ROOT_PID_NAMESPACE)
            for pid in (API, ORPHAN_ENGINE, TRAINER)
        ],
        own=FakeProcEntry(ns_pids=(SIDECAR,), namespace=ROOT_PID_NAMESPACE),
    )
    # The running API server carries the latest start's mark; the engine the first one's.
    add_process(root, API, 1, SERVER_ARGV, {SERVER_MARK_ENV: marks[-1]})
    add_process(root, ORPHAN_ENGINE, 1, ("VLLM::EngineCore",), {SERVER_MARK_ENV: marks[0]})
    add_process(root, TRAINER, 1, ("python", "train.py"), {SERVER_MARK_ENV: "not-ours"})
    pids = frozenset({API})
    preflight = MemoryPreflight(
        latest_nvml=NvmlCollector(server_pids=lambda: pids, pid_mapper=PidMapper(root)).collect,
        cache_config=lambda name: (("gpu_memory_utilization", "0.9"),),
        margin_ratio=0.05,
        proc_root=root,
        server_marks=runtime.server_marks,  # as the agent composes it for a local runtime
    )
    check = preflight.check(instance(pids))
    assert [(h.pid, h.used_bytes, h.own_leftover) for h in check.holders] == [
        (ORPHAN_ENGINE, 70 * GIB, True),
        (TRAINER, 5 * GIB, False),
    ]
    assert f"pid {ORPHAN_ENGINE} (VLLM::EngineCore) holds 71680 MiB on GPU 0, a leftover" in (
        check.reason
    )
