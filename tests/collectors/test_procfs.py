"""Finding vLLM servers and their process trees in /proc (a built tree, and real children)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpilot.agent.runtimes import ProcessRuntime, ProcessTarget, RuntimeUnsupported
from kvpilot.agent.runtimes.base import UnknownInstance
from kvpilot.agent.runtimes.processes import find_vllm_mains
from kvpilot.collectors.procfs import (
    ProcRef,
    descendants,
    is_alive,
    list_processes,
    read_proc,
    start_wall_s,
)

SERVER = ("python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m")
BOOT_S = 1_700_000_000


class FakeProc:
    """A /proc tree written to a directory, in the kernel's formats."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "stat").write_text(f"cpu  1 2 3\nbtime {BOOT_S}\n")

    def add(
        self,
        pid: int,
        ppid: int,
        argv: tuple[str, ...],
        *,
        state: str = "S",
        start_ticks: int = 1000,
        comm: str = "python3",
        env: dict[str, str] | None = None,
        uid: int | None = None,
    ) -> None:
        d = self.root / str(pid)
        d.mkdir()
        rest = " ".join(["0"] * 16)  # session .. itrealvalue
        (d / "stat").write_text(f"{pid} ({comm}) {state} {ppid} {pid} {rest} {start_ticks} 0 0\n")
        # The runtimes trust a server running as the agent's own user (real, effective,
        # saved and filesystem ids, as the kernel writes them).
        owner = os.geteuid() if uid is None else uid
        (d / "status").write_text(f"Name:\t{comm}\nUid:\t{owner}\t{owner}\t{owner}\t{owner}\n")
        (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
        if env is not None:
            (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in env.items()))


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path)


def test_stat_fields_survive_a_command_name_with_spaces_and_parentheses(proc: FakeProc) -> None:
    proc.add(7, 1, SERVER, comm="a) b (c", start_ticks=4242)
    info = read_proc(7, proc.root)
    assert info is not None
    assert (info.pid, info.ppid, info.state, info.start_ticks) == (7, 1, "S", 4242)
    assert info.argv == SERVER


def test_only_the_root_of_a_forked_tree_is_the_main_process(proc: FakeProc) -> None:
    proc.add(10, 1, ("supervisor.py", "--", *SERVER))  # mentions vLLM, is not vLLM
    proc.add(11, 10, SERVER)
    proc.add(12, 11, SERVER)  # forked child, command line not renamed yet
    proc.add(13, 11, ("VLLM::EngineCore",))
    proc.add(14, 13, ("VLLM::Worker",))
    proc.add(15, 13, ("VLLM::Worker",), state="Z")
    procs = list_processes(proc.root)
    assert [info.pid for info in find_vllm_mains(procs)] == [11]
    assert sorted(info.pid for info in descendants(11, procs)) == [12, 13, 14]


def test_port_narrows_the_match_and_zombies_never_match(proc: FakeProc) -> None:
    proc.add(20, 1, (*SERVER, "--port", "9001"))
    proc.add(21, 1, ("vllm", "serve", "m", "--port=9002"))
    proc.add(22, 1, (*SERVER, "--port", "9003"), state="Z")
    procs = list_processes(proc.root)
    assert [info.pid for info in find_vllm_mains(procs)] == [20, 21]
    assert [info.pid for info in find_vllm_mains(procs, port=9002)] == [21]
    assert find_vllm_mains(procs, port=9003) == []


def test_process_runtime_status_and_instances(proc: FakeProc) -> None:
    proc.add(
        30,
        1,
        (*SERVER, "--port", "9001", "--api-key", "k"),
        start_ticks=500,
        env={"KVPILOT_KVPOOL_PORT": "9501"},
    )
    proc.add(31, 30, ("VLLM::EngineCore",))
    wall = iter([123.0, 456.0])
    runtime = ProcessRuntime(
        [
            ProcessTarget("a", port=9001),
            ProcessTarget("b", port=9009, role="canary"),
            ProcessTarget("any"),
        ],
        proc_root=proc.root,
        wall_clock=lambda: next(wall),
    )
    a, b, _any = runtime.instances()
    assert a.url == "http://127.0.0.1:9001"
    assert a.kvpool_url == "http://127.0.0.1:9501"
    assert (a.main_pid, a.pids) == (30, frozenset({30, 31}))
    assert a.started_at_wall_s == pytest.approx(BOOT_S + 500 / os.sysconf("SC_CLK_TCK"))
    assert (b.role, b.main_pid, b.pids) == ("canary", None, frozenset())

    running = runtime.status("a")
    assert (running.state, running.main_pid) == ("running", 30)
    missing = runtime.status("b")
    assert (missing.state, missing.since_wall_s) == ("missing", 123.0)
    assert "--port 9009" in (missing.reason or "")
    assert runtime.status("b").since_wall_s == 123.0  # first observed, not re-stamped

    proc.add(40, 1, ("vllm", "serve", "other"))
    ambiguous = runtime.status("any")
    assert ambiguous.state == "unknown" and "2 vLLM servers" in (ambiguous.reason or "")


def test_process_runtime_refuses_what_only_the_supervisor_can_do(proc: FakeProc) -> None:
    runtime = ProcessRuntime([ProcessTarget("a", port=9001)], proc_root=proc.root)
    with pytest.raises(RuntimeUnsupported, match="cannot start 'a'"):
        asyncio.run(runtime.start("a", ready_timeout_s=1.0))
    with pytest.raises(RuntimeUnsupported, match="command line"):
        asyncio.run(runtime.restart("a", drain_timeout_s=1, ready_timeout_s=1, argv=["vllm"]))
    with pytest.raises(UnknownInstance):
        runtime.status("nope")


def test_process_runtime_restart_names_the_supervisor_deadline(proc: FakeProc) -> None:
    # Nothing runs and nothing comes back: the deadline message says whose job it was.
    runtime = ProcessRuntime([ProcessTarget("a", port=9001)], proc_root=proc.root)
    with pytest.raises(Exception, match=r"supervisor did not bring vLLM 'a' back within 0 s"):
        asyncio.run(runtime.restart("a", drain_timeout_s=0.1, ready_timeout_s=0.2))


def test_real_children_identity_zombies_and_start_time() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        info = read_proc(child.pid)
        assert info is not None and info.ppid == os.getpid() and is_alive(info.ref)
        started = start_wall_s(info)
        assert started is not None and abs(started - time.time()) < 30
        # The same PID with another start time is another process (PID reuse).
        assert not is_alive(ProcRef(info.pid, info.start_ticks + 1))
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (z := read_proc(child.pid)) is not None and z.state != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not is_alive(info.ref)  # a zombie is dead though not yet reaped
    finally:
        child.kill()
        child.wait()
    assert read_proc(child.pid) is None


@pytest.mark.parametrize(
    ("server_host", "host", "found"),
    [
        ((), "127.0.0.1", True),  # no --host: vLLM listens on every address
        (("--host", "0.0.0.0"), "10.0.0.5", True),
        (("--host", "::"), "127.0.0.1", True),
        (("--host", "[::]"), "127.0.0.1", True),
        (("--host=",), "127.0.0.1", True),
        (("--host", "127.0.0.1"), "127.0.0.1", True),
        (("--host=127.0.0.1",), "127.0.0.1", True),
        (("--host", "10.0.0.5"), "127.0.0.1", False),
        (("--host", "localhost"), "127.0.0.1", False),  # names are not resolved
        (("--host", "LocalHost"), "localhost", True),
        (("--host", "::1"), "::1", True),
        (("--host", "[::1]"), "::1", True),
        (("--host", "::1"), "[::1]", True),
        (("--host", "127.0.0.1"), None, True),  # no host set: a loopback --host
        # No host set, and an address that is not this machine's: the process chose where
        # kvpilot would send vLLM's API key, so it is not trusted.
        (("--host", "10.0.0.5"), None, False),
    ],
)
def test_host_matches_where_the_server_listens(
    proc: FakeProc, server_host: tuple[str, ...], host: str | None, found: bool
) -> None:
    proc.add(50, 1, (*SERVER, "--port", "9001", *server_host))
    runtime = ProcessRuntime([ProcessTarget("a", port=9001, host=host)], proc_root=proc.root)
    assert (runtime.status("a").main_pid == 50) is found


@pytest.mark.parametrize(
    ("pattern", "found"),
    [
        (r"--served-model-name tiny\b", True),
        (r"^python3 -m vllm\.entrypoints", True),  # the whole command line, from its start
        (r"--model m --port 9001", True),  # arguments joined by single spaces
        (r"--served-model-name tiny-llama", False),
        (r"^--model", False),
    ],
)
def test_cmdline_regex_is_searched_in_the_arguments_joined_by_spaces(
    proc: FakeProc, pattern: str, found: bool
) -> None:
    proc.add(60, 1, (*SERVER, "--port", "9001", "--served-model-name", "tiny"))
    target = ProcessTarget("a", port=9001, cmdline_regex=pattern)
    runtime = ProcessRuntime([target], proc_root=proc.root)
    assert (runtime.status("a").main_pid == 60) is found
