"""The process runtime attaches only to the server its settings describe, and signals only it.

Stand-in servers (`vllm_stub.py`: vLLM's command line, the readiness probe's answers) run as
real processes, each in its own process group; `supervisor.py` brings one back after a
restart as systemd or the kubelet would.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpilot.agent.app.parts import build_runtime
from kvpilot.agent.config import AgentConfig
from kvpilot.agent.runtimes import Runtime, RuntimeFailure
from kvpilot.agent.runtimes import process as process_module
from kvpilot.collectors.procfs import ProcRef, is_alive, list_processes, read_proc
from kvpilot.rig.server import free_port, stop_process_group

HERE = Path(__file__).parent
STUB = HERE / "vllm_stub.py"
SUPERVISOR = HERE / "supervisor.py"
NAME = "vllm"  # the process runtime's default instance name


def wait_until(what: str, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def ref_of(pid: int) -> ProcRef:
    info = read_proc(pid)
    assert info is not None, f"PID {pid} is not running"
    return info.ref


class Stubs:
    """Starts stand-in servers (directly, or under the supervisor); stops every one at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.program = tmp / "vllm"  # the name makes `python .../vllm serve` vLLM's form
        shutil.copyfile(STUB, self.program)
        self.started: list[subprocess.Popen[bytes]] = []

    def server(self, *args: str, supervised: bool = False) -> subprocess.Popen[bytes]:
        """A running stand-in `vllm serve m ARGS` (the supervisor's Popen when supervised)."""
        ready = self.tmp / f"ready-{uuid.uuid4().hex}"
        command = [sys.executable, str(self.program), "serve", "m", *args]
        if supervised:
            command = [sys.executable, str(SUPERVISOR), "--", *command]
        with (self.tmp / f"{ready.name}.log").open("ab") as log:
            process = subprocess.Popen(
                command,
                env={**os.environ, "STUB_READY_FILE": str(ready)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stopped whole, whatever it started
            )
        self.started.append(process)
        wait_until(f"stand-in {args} to be up", ready.exists)
        return process

    def close(self) -> None:
        for process in self.started:
            # A leader already reaped had its group to itself (the supervisors outlive their
            # children): its PID may be someone else's by now, so it is left alone.
            if process.poll() is None:
                stop_process_group(process, grace_s=5.0)


@pytest.fixture
def stubs(tmp_path: Path) -> Iterator[Stubs]:
    started = Stubs(tmp_path)
    try:
        yield started
    finally:
        started.close()


def runtime_for(**settings: Any) -> Runtime:
    """The runtime `kvpilot run` builds from `runtime: {kind: process, ...settings}`."""
    config = AgentConfig.model_validate({"runtime": {"kind": "process", **settings}})
    return build_runtime(config)


def child_of(supervisor: subprocess.Popen[bytes]) -> int:
    (pid,) = [i.pid for i in list_processes().values() if i.ppid == supervisor.pid and i.alive]
    return pid


def test_cmdline_regex_tells_apart_two_servers_on_one_port(stubs: Stubs) -> None:
    port = str(free_port())
    alpha = stubs.server("--port", port, "--served-model-name", "alpha")
    beta = stubs.server("--port", port, "--served-model-name", "beta")
    alpha_ref = ref_of(alpha.pid)
    # Alike but for the name: by port alone the runtime cannot tell which, and acts on neither.
    unsure = runtime_for(port=int(port)).status(NAME)
    assert unsure.state == "unknown" and "2 vLLM servers" in (unsure.reason or "")

    runtime = runtime_for(port=int(port), cmdline_regex=r"--served-model-name beta\b")
    status = runtime.status(NAME)
    assert (status.state, status.main_pid) == ("running", beta.pid)
    (instance,) = runtime.instances()
    assert instance.main_pid == beta.pid and alpha.pid not in instance.pids

    stopped = asyncio.run(runtime.stop(NAME, drain_timeout_s=10.0))
    assert stopped.was_running and stopped.drained
    assert beta.wait(timeout=10) == -signal.SIGTERM
    assert alpha.poll() is None and is_alive(alpha_ref)


def test_host_picks_the_server_listening_there_and_a_restart_signals_only_it(
    stubs: Stubs,
) -> None:
    port = str(free_port())
    near = stubs.server("--host", "127.0.0.1", "--port", port)
    far = stubs.server("--host", "127.0.0.2", "--port", port, supervised=True)
    near_ref, far_pid = ref_of(near.pid), child_of(far)

    runtime = runtime_for(port=int(port), host="127.0.0.2")
    status = runtime.status(NAME)
    assert (status.state, status.main_pid) == ("running", far_pid)
    assert runtime.instances()[0].url == f"http://127.0.0.2:{port}"
    assert runtime_for(port=int(port), host="127.0.0.1").status(NAME).main_pid == near.pid

    again = asyncio.run(runtime.restart(NAME, drain_timeout_s=10.0, ready_timeout_s=30.0))
    assert again.main_pid is not None and again.main_pid != far_pid
    assert again.main_pid == child_of(far)  # the supervisor's new process, probed at its host
    assert again.url == f"http://127.0.0.2:{port}"
    assert near.poll() is None and is_alive(near_ref)


def test_a_server_on_every_address_matches_a_host(stubs: Stubs) -> None:
    port = str(free_port())
    anywhere = stubs.server("--port", port)  # no --host: vLLM listens on every address
    assert runtime_for(port=int(port), host="127.0.0.1").status(NAME).main_pid == anywhere.pid
    elsewhere = runtime_for(port=int(port), cmdline_regex="--served-model-name").status(NAME)
    assert elsewhere.state == "missing" and "matching '--served-model-name'" in (
        elsewhere.reason or ""
    )


def test_a_server_that_became_another_program_is_never_signalled(
    stubs: Stubs, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = str(free_port())
    server = stubs.server("--port", port)
    runtime = runtime_for(port=int(port))
    assert runtime.status(NAME).main_pid == server.pid
    # The runtime goes on seeing /proc as it was when it found the server ...
    seen = list_processes()
    monkeypatch.setattr(process_module, "list_processes", lambda *_: seen)
    # ... while that PID now runs another program: same process, same start time.
    before = read_proc(server.pid)
    assert before is not None
    os.kill(server.pid, signal.SIGUSR1)
    wait_until("the exec", lambda: (read_proc(server.pid) or before).argv != before.argv)
    assert ref_of(server.pid) == before.ref

    with pytest.raises(RuntimeFailure, match=rf"PID {server.pid} no longer matches"):
        asyncio.run(runtime.stop(NAME, drain_timeout_s=5.0))
    with pytest.raises(RuntimeFailure, match=rf"PID {server.pid} no longer matches"):
        asyncio.run(runtime.restart(NAME, drain_timeout_s=5.0, ready_timeout_s=5.0))
    assert server.poll() is None and is_alive(before.ref)
    monkeypatch.undo()
    assert runtime.status(NAME).state == "missing"  # a fresh look does not find it either
