"""The local runtime leaves no process of a server it stopped, whatever killed its leader.

vLLM's engine core and workers outlive a killed API server (vLLM issue 55510) and may ignore
SIGTERM; a stand-in server (tests/fakes/standin_vllm_module.py) starts such an engine as a
real child process, in the server's group or in a session of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from kvpilot.agent.runtimes import LocalInstanceSpec, LocalRuntime
from kvpilot.agent.runtimes.processes import SERVER_MARK_ENV
from kvpilot.collectors.procfs import list_processes, read_environ
from kvpilot.rig.server import free_port
from tests.fakes.standin_vllm_module import install


def _standin(tmp_path: Path, plan: str) -> LocalInstanceSpec:
    env = {
        "PYTHONPATH": str(install(tmp_path / "standin")),
        "STANDIN_PLAN": plan,
        "STANDIN_STARTS": str(tmp_path / "starts"),
        "STANDIN_TAG": str(tmp_path),
    }
    port = str(free_port())
    argv = (sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m")
    return LocalInstanceSpec("tiny", (*argv, "--port", port), env=tuple(env.items()))


def _tagged(tag: str) -> list[int]:
    """Live processes whose command line carries the stand-in's tag."""
    return sorted(info.pid for info in list_processes().values() if info.alive and tag in info.argv)


def _wait(what: str, predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_an_engine_orphaned_by_a_killed_leader_is_stopped(tmp_path: Path) -> None:
    tag = str(tmp_path)
    runtime = LocalRuntime([_standin(tmp_path, "engine")], tmp_path / "logs")
    try:
        main = asyncio.run(runtime.start("tiny", ready_timeout_s=30)).main_pid
        assert main is not None
        _wait("the engine child", lambda: len(_tagged(tag)) == 1)
        (engine,) = _tagged(tag)
        os.kill(main, signal.SIGKILL)  # the OOM killer's way: no shutdown path runs
        # The runtime notices the exit (and reaps its child) before anything stops it.
        _wait("the exit seen", lambda: runtime.status("tiny").state == "exited")
        assert _tagged(tag) == [engine], "the engine outlives its leader"
        result = asyncio.run(runtime.stop("tiny", drain_timeout_s=1.0))
        assert engine in result.killed_pids
        assert _tagged(tag) == []
    finally:
        _kill(_tagged(tag))


def test_an_engine_in_a_session_of_its_own_is_stopped_with_its_server(tmp_path: Path) -> None:
    tag = str(tmp_path)
    runtime = LocalRuntime([_standin(tmp_path, "detached")], tmp_path / "logs")
    try:
        asyncio.run(runtime.start("tiny", ready_timeout_s=30))
        _wait("the engine child", lambda: len(_tagged(tag)) == 1)
        (engine,) = _tagged(tag)
        # It leaves the server's group when its interpreter runs os.setsid(), a moment after
        # it appears.
        _wait("the engine's own session", lambda: os.getpgid(engine) == engine)
        mark = (read_environ(engine) or {}).get(SERVER_MARK_ENV)
        assert mark, "every process of the server carries its mark"
        assert engine in runtime.instances()[0].pids
        # A restart stops the old server first: its engine goes with it.
        asyncio.run(runtime.restart("tiny", drain_timeout_s=1.0, ready_timeout_s=30))
        _wait("the new engine", lambda: engine not in _tagged(tag) and len(_tagged(tag)) == 1)
        asyncio.run(runtime.aclose(drain_timeout_s=1.0))
        assert _tagged(tag) == []
    finally:
        _kill(_tagged(tag))
