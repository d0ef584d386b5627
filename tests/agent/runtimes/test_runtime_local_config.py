"""The local runtime's configuration is checked before anything is started."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvpilot.agent.runtimes import (
    LocalInstanceSpec,
    LocalRuntime,
    NotAVllmServer,
    Runtime,
    UnknownInstance,
)

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
