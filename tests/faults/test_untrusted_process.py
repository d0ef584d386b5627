"""The process runtime trusts a local process as the server only when it runs as the expected
uid and listens on this machine: another user's look-alike, or one whose --host sends the
agent (and vLLM's API key) elsewhere, is never probed or signalled. Another user's server,
when it is the only one, is still there: reported running (never a false "missing"), and a
stop or restart says why it cannot act.

The look-alikes are real processes: a file named `vllm` that sleeps, run as
`python DIR/vllm serve m --port P ...`, which /proc shows as vLLM's launch form.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpilot.agent.app.parts import build_runtime
from kvpilot.agent.config import AgentConfig
from kvpilot.agent.runtimes.process import NotPermitted
from kvpilot.collectors.procfs import read_proc
from kvpilot.rig.server import free_port

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture
def lookalike() -> Iterator[Any]:
    """Starts `vllm serve m ARGS` look-alikes (optionally as another user); stops them all."""
    folder = Path(tempfile.mkdtemp(prefix="kvpilot-lookalike-"))
    folder.chmod(0o755)  # another user runs the program from here
    program = folder / "vllm"
    program.write_text("import time\ntime.sleep(120)\n")
    program.chmod(0o644)
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str, user: int | None = None) -> subprocess.Popen[bytes]:
        # Another user may not reach this interpreter (under /root): the system's, then.
        python = sys.executable if user is None else SYSTEM_PYTHON
        command = [python, str(program), "serve", "m", *args]
        process = subprocess.Popen(
            command, user=user, stdin=subprocess.DEVNULL, start_new_session=True, cwd="/"
        )
        started.append(process)
        deadline = time.monotonic() + 10
        while (info := read_proc(process.pid)) is None or "serve" not in info.argv:
            assert time.monotonic() < deadline, "the look-alike did not start"
            time.sleep(0.02)
        return process

    try:
        yield start
    finally:
        for process in started:
            process.kill()
            process.wait(timeout=10)
        program.unlink()
        folder.rmdir()


def _runtime(**settings: Any) -> Any:
    config = AgentConfig.model_validate({"runtime": {"kind": "process", **settings}})
    return build_runtime(config)


def test_a_server_of_another_uid_than_expected_is_reported_and_never_signalled(
    lookalike: Any,
) -> None:
    port = free_port()
    mine = lookalike("--port", str(port))
    assert _runtime(port=port).status("vllm").main_pid == mine.pid  # the agent's own uid
    runtime = _runtime(port=port, expected_uid=os.geteuid() + 4242)
    other = runtime.status("vllm")
    assert (other.state, other.main_pid) == ("running", mine.pid)  # there, not "missing"
    assert f"runs as uid {os.geteuid()}" in (other.reason or "")
    with pytest.raises(NotPermitted, match=f"runs as uid {os.geteuid()}"):
        asyncio.run(runtime.restart("vllm", drain_timeout_s=1, ready_timeout_s=1))
    assert mine.poll() is None  # not signalled


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path(SYSTEM_PYTHON).exists(),
    reason="starting a process as another user needs root (and a system python3)",
)
def test_another_users_lookalike_neither_blocks_nor_replaces_the_server(lookalike: Any) -> None:
    port = free_port()
    mine = lookalike("--port", str(port))
    theirs = lookalike("--port", str(port), user=NOBODY)
    runtime = _runtime(port=port)
    status = runtime.status("vllm")
    assert (status.state, status.main_pid) == ("running", mine.pid)  # not "2 servers match"
    assert theirs.pid not in runtime.instances()[0].pids
    mine.kill()
    mine.wait(timeout=10)
    alone = runtime.status("vllm")  # another user's server, alone: there, never signalled
    assert (alone.state, alone.main_pid) == ("running", theirs.pid)
    assert f"runs as uid {NOBODY}" in (alone.reason or "")
    with pytest.raises(NotPermitted):
        asyncio.run(runtime.stop("vllm", drain_timeout_s=1))
    assert theirs.poll() is None
    trusted = _runtime(port=port, expected_uid=NOBODY).status("vllm")
    assert (trusted.main_pid, trusted.reason) == (theirs.pid, None)


# Run as another user: a process runtime told to expect root's server restarts it.
AS_NOBODY = """
import asyncio, sys
from kvpilot.agent.runtimes.process import NotPermitted, ProcessRuntime, ProcessTarget
runtime = ProcessRuntime([ProcessTarget("vllm", port=int(sys.argv[1]), expected_uid=0)])
print(runtime.status("vllm").state)
try:
    asyncio.run(runtime.restart("vllm", drain_timeout_s=1, ready_timeout_s=1))
except NotPermitted as exc:
    print(exc)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="running the runtime as another user needs root")
def test_a_restart_that_may_not_signal_the_server_says_eperm(lookalike: Any) -> None:
    port = free_port()
    server = lookalike("--port", str(port))  # root's
    as_nobody = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
    try:
        ran = subprocess.run(
            [*as_nobody, sys.executable, "-c", AS_NOBODY, str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
    except FileNotFoundError:
        pytest.skip("setpriv (util-linux) is not installed")
    if not ran.stdout:  # nothing ran: the interpreter or kvpilot is out of that user's reach
        pytest.skip(f"another user cannot run this interpreter here: {ran.stderr[-300:]}")
    assert ran.returncode == 0, ran.stderr  # a PermissionError's traceback is no answer
    state, message = ran.stdout.splitlines()
    assert state == "running", ran.stderr
    assert f"cannot signal PID {server.pid}" in message and "EPERM" in message
    assert "uid 0" in message
    assert server.poll() is None


@pytest.mark.parametrize("host", ["203.0.113.9", "collector.attacker.example", "[2001:db8::9]"])
def test_a_server_saying_another_machines_host_is_not_trusted(lookalike: Any, host: str) -> None:
    port = free_port()
    lookalike("--host", host, "--port", str(port))
    runtime = _runtime(port=port)
    status = runtime.status("vllm")
    assert status.main_pid is None and "not this machine's" in (status.reason or "")
    (instance,) = runtime.instances()
    assert instance.url == f"http://127.0.0.1:{port}"  # never where the process said


def test_a_server_on_a_loopback_name_is_reached_on_loopback(lookalike: Any) -> None:
    port = free_port()
    server = lookalike("--host", "localhost", "--port", str(port))
    (instance,) = _runtime(port=port).instances()
    assert instance.main_pid == server.pid and instance.url == f"http://127.0.0.1:{port}"
