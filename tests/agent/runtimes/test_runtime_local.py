"""The local runtime against a real CPU vLLM: no shell, the API key, logs across restarts."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpilot.agent.model import Instance
from kvpilot.agent.runtimes import LocalInstanceSpec, LocalRuntime
from kvpilot.collectors.procfs import read_environ, read_proc
from kvpilot.rig.server import (
    KVPOOL_PORT_ENV,
    ServerSpec,
    build_argv,
    build_env,
    free_kvpool_port,
    free_port,
)

pytestmark = pytest.mark.slow

NAME = "canary-1"
API_KEY = "s3cret-key-for-the-probe"
READY_S = 240.0


@dataclass
class Started:
    runtime: LocalRuntime
    spec: ServerSpec
    argv: tuple[str, ...]
    served_name: str
    marker: Path  # the file `$(touch ...)` would create if a shell ever saw the argv
    popen_calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
    first: Instance


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    tmp = tmp_path_factory.mktemp("local-runtime")
    marker = tmp / "shell-ran"
    served_name = f"tiny$(touch {marker})"
    spec = ServerSpec(
        port=free_port(),
        kvpool_port=free_kvpool_port(),
        kv_cache_memory_bytes=16 * 1024 * 1024,
        shutdown_timeout_s=5,
        api_key=API_KEY,
        served_model_name=served_name,
    )
    argv = tuple(build_argv(spec))
    runtime = LocalRuntime(
        [LocalInstanceSpec(NAME, argv, role="canary", kvpool_port=spec.kvpool_port)],
        tmp / "logs",
        base_env=build_env(spec),
    )
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    real_popen = subprocess.Popen

    def recording_popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        calls.append((args, kwargs))
        return real_popen(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "Popen", recording_popen)
        try:
            first = asyncio.run(runtime.start(NAME, ready_timeout_s=READY_S))
            yield Started(runtime, spec, argv, served_name, marker, calls, first)
        finally:
            asyncio.run(runtime.aclose(drain_timeout_s=60.0))


def _models(url: str, api_key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0)


def test_the_server_is_started_from_a_list_never_through_a_shell(started: Started) -> None:
    ((args, kwargs),) = started.popen_calls
    assert isinstance(args[0], list)
    assert args[0] == list(started.argv)
    assert kwargs.get("shell", False) is False
    assert kwargs.get("start_new_session") is True
    # The `$(touch ...)` argument reached vLLM verbatim: no shell expanded it.
    assert not started.marker.exists()
    main = read_proc(started.first.main_pid or -1)
    assert main is not None and started.served_name in main.argv
    served = _models(started.first.url, API_KEY).json()["data"][0]["id"]
    assert served == started.served_name


def test_the_instance_carries_role_and_its_plugin_port(started: Started) -> None:
    assert started.first.role == "canary"
    assert started.first.kvpool_url == f"http://127.0.0.1:{started.spec.kvpool_port}"
    environ = read_environ(started.first.main_pid or -1)
    assert environ is not None
    assert environ[KVPOOL_PORT_ENV] == str(started.spec.kvpool_port)


def test_the_api_key_is_enforced_and_the_probe_sends_it(started: Started) -> None:
    # The server refuses requests without the key, so start()'s probe must have sent it.
    assert _models(started.first.url, None).status_code == 401
    assert _models(started.first.url, API_KEY).status_code == 200


def test_restart_with_a_new_argv_logs_both_runs_in_one_file(started: Started) -> None:
    runtime = started.runtime
    new_argv = (*started.argv, "--max-num-seqs", "4")
    instance = asyncio.run(
        runtime.restart(NAME, drain_timeout_s=60.0, ready_timeout_s=READY_S, argv=new_argv)
    )
    assert instance.main_pid is not None and instance.main_pid != started.first.main_pid
    assert instance.argv == new_argv
    main = read_proc(instance.main_pid)
    assert main is not None and main.argv[-2:] == ("--max-num-seqs", "4")
    assert _models(instance.url, API_KEY).status_code == 200  # the probe passed with the key

    log = runtime.log_path(NAME).read_text(errors="replace")
    headers = [line for line in log.splitlines() if line.startswith("===== kvpilot: start #")]
    assert [h.split()[3] for h in headers] == ["#1", "#2"]
    assert API_KEY not in "\n".join(headers)  # the key is redacted from the log
    first_run, second_run = log.split(headers[1])
    # vLLM's own output from each run landed under its header, the first run's drain too.
    for run in (first_run, second_run):
        assert "Application startup complete" in run
    assert "stopping engine client mode=drain timeout=5s" in first_run
    assert "shutdown triggered" not in second_run
    assert len(started.popen_calls) == 2
    assert all(kwargs.get("shell", False) is False for _args, kwargs in started.popen_calls)


def test_restart_refuses_a_command_that_is_not_vllm_before_touching_the_server(
    started: Started,
) -> None:
    before = started.runtime.status(NAME)
    with pytest.raises(ValueError, match="not a vLLM server"):
        asyncio.run(
            started.runtime.restart(
                NAME, drain_timeout_s=1.0, ready_timeout_s=1.0, argv=("sh", "-c", "true")
            )
        )
    assert started.runtime.status(NAME) == before
