"""The local runtime when a server cannot start: stand-in server processes (no vLLM).

A server that exits before it is ready, a program that is not there, a Python without vLLM:
each is a StartFailed with one sentence, the log of that start and, where kvpilot can tell,
what to change. Signals reach only the processes they are meant for (pidfd, by identity).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpilot.agent.runtimes import LocalInstanceSpec, LocalRuntime, NotReady
from kvpilot.agent.runtimes.launch_hint import no_vllm_hint, not_found_hint
from kvpilot.agent.runtimes.probe import StartFailed
from kvpilot.agent.runtimes.processes import kill_group, send_signal
from kvpilot.collectors.procfs import ProcRef, is_alive, read_proc
from kvpilot.rig.server import free_port
from tests.fakes.standin_vllm_module import install

PYENV_LOG = (
    "/root/.pyenv/versions/3.11.7/bin/python: Error while finding module specification for "
    "'vllm.entrypoints.openai.api_server' (ModuleNotFoundError: No module named 'vllm')\n"
)


def _standin(tmp_path: Path, plan: str, program: str = sys.executable) -> LocalInstanceSpec:
    env = {
        "PYTHONPATH": str(install(tmp_path / "standin")),
        "STANDIN_PLAN": plan,
        "STANDIN_STARTS": str(tmp_path / "starts"),
        "STANDIN_TAG": str(tmp_path),
    }
    argv = (
        program,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "m",
        "--port",
        str(free_port()),
    )
    return LocalInstanceSpec("tiny", argv, env=tuple(env.items()))


def test_a_server_that_exits_says_so_with_the_log_of_that_start(tmp_path: Path) -> None:
    runtime = LocalRuntime([_standin(tmp_path, "exit")], tmp_path / "logs")

    async def twice() -> StartFailed:
        for _ in range(2):
            with pytest.raises(StartFailed) as info:
                await runtime.start("tiny", ready_timeout_s=30)
        return info.value

    failed = asyncio.run(twice())
    assert isinstance(failed, NotReady)
    assert failed.summary == "the vLLM server 'tiny' exited before it was ready (exit code 3)"
    assert failed.hint is None and failed.log_path == tmp_path / "logs" / "tiny.log"
    lines = failed.explain().splitlines()
    assert lines[0] == f"--- the last lines of {tmp_path / 'logs' / 'tiny.log'} ---"
    assert lines[1:] == [
        f"stand-in vLLM ({tmp_path}): start in mode exit",
        "RuntimeError: stand-in vLLM failed to start (no KV cache memory)",
        "---",
        f"kvpilot: {failed.summary}.",
    ]  # the second start's output only, once
    assert runtime.status("tiny").state == "exited"


def test_a_program_that_is_not_there_is_a_start_failure(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "bin" / "python"
    specs = [
        LocalInstanceSpec("by-path", (str(missing), *_standin(tmp_path, "serve").argv[1:])),
        LocalInstanceSpec(
            "on-path", ("vllm", "serve", "m", "--port", str(free_port())), env=(("PATH", "/x"),)
        ),
    ]
    runtime = LocalRuntime(specs, tmp_path / "logs")
    failures = {}
    for name in ("by-path", "on-path"):
        with pytest.raises(StartFailed) as info:
            asyncio.run(runtime.start(name, ready_timeout_s=30))
        failures[name] = info.value
        assert runtime.status(name).state == "missing"
        assert "kvpilot: cannot execute" in (runtime.log_tail(name) or "")
    assert failures["by-path"].summary == (
        f"the vLLM server 'by-path' could not be started ({missing}: No such file or directory)"
    )
    assert failures["by-path"].hint == (
        f"{str(missing)!r} does not exist or cannot be executed; fix the path in `argv`"
    )
    assert (failures["on-path"].hint or "").startswith(
        "'vllm' is not on the server's PATH; give its full path in `argv`, e.g. "
    )


def test_a_python_without_vllm_is_named_with_what_to_set(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    spec = _standin(tmp_path, "serve", program="python")
    env = dict(spec.env) | {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "PYTHONPATH": ""}
    runtime = LocalRuntime(
        [LocalInstanceSpec("tiny", spec.argv, env=tuple(env.items()))], tmp_path / "logs"
    )
    with pytest.raises(StartFailed) as info:
        asyncio.run(runtime.start("tiny", ready_timeout_s=30))
    hint = info.value.hint or ""
    assert hint.startswith(f"the argv's 'python' resolved to {venv / 'bin' / 'python'}")
    assert "which has no vllm; use the virtualenv's python in `argv`, e.g. " in hint
    assert "No module named 'vllm'" in info.value.explain()


def test_the_hint_names_the_interpreter_a_shim_ran(tmp_path: Path) -> None:
    shim = tmp_path / "python"
    shim.write_text("#!/bin/sh\n")
    shim.chmod(0o755)
    hint = no_vllm_hint(
        ["python", "-m", "vllm.entrypoints.openai.api_server"], str(tmp_path), PYENV_LOG
    )
    assert hint is not None
    assert hint.startswith(
        f"the argv's 'python' resolved to {shim} (which ran /root/.pyenv/versions/3.11.7/bin/"
        "python), which has no vllm"
    )
    assert no_vllm_hint(["python"], str(tmp_path), "CUDA out of memory") is None
    assert "give its full path in `argv`" in not_found_hint("vllm", "/nowhere")
    assert "fix the path in `argv`" in not_found_hint("/opt/venv/bin/python", "/nowhere")


def test_signals_reach_a_process_only_as_itself(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        info = read_proc(sleeper.pid)
        assert info is not None
        impostor = ProcRef(info.pid, info.start_ticks + 1)  # same PID, another process
        assert not send_signal(impostor, signal.SIGTERM)
        assert sleeper.poll() is None
        assert kill_group(sleeper.pid) == [sleeper.pid]
        sleeper.wait(timeout=10)
        assert not is_alive(info.ref)
        assert not send_signal(info.ref, signal.SIGTERM)  # gone: nothing sent
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_stop_ends_the_whole_group_of_a_server_that_never_got_ready(tmp_path: Path) -> None:
    runtime = LocalRuntime([_standin(tmp_path, "hang")], tmp_path / "logs")

    async def start_then_stop() -> None:
        starting = asyncio.create_task(runtime.start("tiny", ready_timeout_s=300))
        deadline = time.monotonic() + 20
        while len(runtime.instances()[0].pids) < 2:  # the server and its child
            assert time.monotonic() < deadline, "the stand-in did not start its child"
            await asyncio.sleep(0.05)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        result = await runtime.stop("tiny", drain_timeout_s=2.0)
        assert result.was_running and result.drained  # SIGTERM ended the server
        assert len(result.killed_pids) == 1  # its child, by SIGKILL

    asyncio.run(start_then_stop())
    assert runtime.instances()[0].pids == frozenset()
