"""The local runtime's configuration is checked before anything is started."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from kvpilot.agent.runtimes import (
    LocalInstanceSpec,
    LocalRuntime,
    NotAVllmServer,
    Runtime,
    RuntimeFailure,
    UnknownInstance,
)
from kvpilot.rig.server import free_port

ARGV = ("python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port", "9100")


def test_a_command_that_is_not_vllm_is_refused(tmp_path: Path) -> None:
    with pytest.raises(NotAVllmServer, match="not a vLLM server"):
        LocalRuntime([LocalInstanceSpec("a", ("bash", "-c", "vllm serve m"))], tmp_path)


def test_instance_names_are_unique(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="duplicate instance name 'a'"):
        LocalRuntime([LocalInstanceSpec("a", ARGV), LocalInstanceSpec("a", ARGV)], tmp_path)


def test_before_start_the_instance_is_listed_without_processes(tmp_path: Path) -> None:
    runtime = LocalRuntime(
        [LocalInstanceSpec("a", ARGV, role="canary", kvpool_port=9600)], tmp_path
    )
    assert isinstance(runtime, Runtime)
    (instance,) = runtime.instances()
    assert (instance.url, instance.kvpool_url) == ("http://127.0.0.1:9100", "http://127.0.0.1:9600")
    assert (instance.role, instance.pids, instance.main_pid) == ("canary", frozenset(), None)
    status = runtime.status("a")
    assert (status.state, status.reason) == ("missing", "not started")
    result = asyncio.run(runtime.stop("a", drain_timeout_s=1.0))
    assert not result.was_running and result.killed_pids == ()
    with pytest.raises(UnknownInstance, match="'b'"):
        runtime.status("b")
    assert not (tmp_path / "a.log").exists()  # nothing was started, nothing was logged


def test_a_cpu_set_that_cannot_be_applied_fails_the_start_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    argv = (sys.executable, *ARGV[1:5], "--port", str(free_port()))
    runtime = LocalRuntime([LocalInstanceSpec("a", argv, cpus=(100_000,))], tmp_path)
    with pytest.raises(RuntimeFailure, match=r"cannot pin 'a' to CPUs \[100000\]"):
        asyncio.run(runtime.start("a", ready_timeout_s=5.0))
    (instance,) = runtime.instances()
    assert instance.pids == frozenset()
    assert runtime.status("a").state != "running"
