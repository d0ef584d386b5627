"""One contract, every runtime: a real CPU vLLM listed, killed, restarted and stopped.

`local` runs the server itself; `process` attaches to a server that `supervisor.py` (a
stand-in for systemd or the kubelet) runs and restarts. Each runtime's server is shared by
the tests of this module, which run in order: list, outside kill, restart, drain and stop.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvpilot.agent.runtimes import (
    LocalInstanceSpec,
    LocalRuntime,
    ProcessRuntime,
    ProcessTarget,
    Runtime,
    StopResult,
)
from kvpilot.agent.runtimes.drain import wait_for
from kvpilot.agent.runtimes.probe import wait_ready
from kvpilot.collectors.procfs import ProcRef, is_alive, read_proc
from kvpilot.rig.server import (
    ServerSpec,
    build_argv,
    build_env,
    free_kvpool_port,
    free_port,
    stop_process_group,
)

pytestmark = pytest.mark.slow

SUPERVISOR = Path(__file__).with_name("supervisor.py")
NAME = "main"
READY_S = 240.0
DRAIN_S = 60.0


@dataclass
class Harness:
    kind: str
    runtime: Runtime
    spec: ServerSpec
    log_path: Path
    hold_file: Path | None = None  # process: while it exists, the supervisor does not restart
    seen_main_pids: set[int] = field(default_factory=set)
    # The engine and workers of a server killed outright: they outlive it (vLLM issue 55510)
    # until the runtime's next stop or restart ends them.
    orphans: list[ProcRef] = field(default_factory=list)

    def hold(self) -> None:
        if self.hold_file is not None:
            self.hold_file.touch()

    def release(self) -> None:
        if self.hold_file is not None:
            self.hold_file.unlink(missing_ok=True)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def _spec() -> ServerSpec:
    return ServerSpec(
        port=free_port(),
        kvpool_port=free_kvpool_port(),
        kv_cache_memory_bytes=16 * 1024 * 1024,
        # Room to drain on a busy two-core box; an idle server still stops at once.
        shutdown_timeout_s=30,
    )


@pytest.fixture(scope="module", params=["local", "process"])
def harness(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Harness]:
    spec = _spec()
    tmp = tmp_path_factory.mktemp(f"runtime-{request.param}")
    if request.param == "local":
        runtime = LocalRuntime(
            [LocalInstanceSpec(NAME, tuple(build_argv(spec)), kvpool_port=spec.kvpool_port)],
            tmp / "logs",
            base_env=build_env(spec),
        )
        h = Harness("local", runtime, spec, runtime.log_path(NAME))
        try:
            asyncio.run(runtime.start(NAME, ready_timeout_s=READY_S))
            yield h
        finally:
            asyncio.run(runtime.aclose(drain_timeout_s=DRAIN_S))
        return
    hold_file = tmp / f"hold-{uuid.uuid4().hex}"
    log_path = tmp / "supervised.log"
    with log_path.open("ab") as log:
        supervisor = subprocess.Popen(
            [
                sys.executable,
                str(SUPERVISOR),
                "--hold-file",
                str(hold_file),
                "--",
                *build_argv(spec),
            ],
            env=build_env(spec),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # the supervisor and everything it runs: one group
        )
    h = Harness(
        "process", ProcessRuntime([ProcessTarget(NAME, port=spec.port)]), spec, log_path, hold_file
    )
    try:
        asyncio.run(wait_ready(spec.url, api_key=None, timeout_s=READY_S, log_tail=h.log_tail))
        yield h
    finally:
        stop_process_group(supervisor, grace_s=30.0)


def _main_ref(h: Harness) -> ProcRef:
    status = h.runtime.status(NAME)
    assert status.state == "running", status
    assert status.main_pid is not None
    info = read_proc(status.main_pid)
    assert info is not None
    h.seen_main_pids.add(info.pid)
    return info.ref


async def _complete(url: str, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=120.0) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True}
        reply = await client.post(f"{url}/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()


def test_instances_list_the_server_with_role_url_and_pids(harness: Harness) -> None:
    (instance,) = harness.runtime.instances()
    main = _main_ref(harness)
    assert instance.name == NAME
    assert instance.role == "stable"
    assert instance.url == harness.spec.url
    assert instance.main_pid == main.pid
    assert main.pid in instance.pids
    assert len(instance.pids) >= 2, "the engine core runs in a child process"
    assert all(read_proc(pid) is not None for pid in instance.pids)
    assert instance.argv is not None and "--port" in instance.argv
    # The plugin port reached the server's environment: the plugin serves there.
    assert instance.kvpool_url == f"http://127.0.0.1:{harness.spec.kvpool_port}"
    reply = httpx.get(f"{instance.kvpool_url}/metrics", timeout=10.0)
    assert reply.status_code == 200 and "# TYPE kvpool_" in reply.text


def test_vllm_killed_outright_is_detected(harness: Harness) -> None:
    main = _main_ref(harness)
    harness.hold()  # process: keep the supervisor from starting it again at once
    (before,) = harness.runtime.instances()
    tree = [read_proc(pid) for pid in before.pids if pid != main.pid]
    harness.orphans = [info.ref for info in tree if info is not None]
    os.kill(main.pid, signal.SIGKILL)
    assert asyncio.run(wait_for(lambda: harness.runtime.status(NAME).state != "running", 30.0))
    status = harness.runtime.status(NAME)
    assert status.main_pid is None
    assert status.since_wall_s is not None
    if harness.kind == "local":
        assert status.state == "exited"
        assert status.exit_code == -signal.SIGKILL
    else:
        assert status.state == "missing", status
    assert harness.runtime.instances()[0].main_pid is None
    if harness.kind == "process":
        # The supervisor brings it back once allowed; the runtime then sees a new process.
        harness.release()
        assert asyncio.run(
            wait_for(lambda: harness.runtime.status(NAME).state == "running", READY_S)
        ), harness.log_tail()
        assert _main_ref(harness) != main
        asyncio.run(wait_ready(harness.spec.url, api_key=None, timeout_s=READY_S))


def test_restart_gives_a_new_healthy_server_that_answers(harness: Harness) -> None:
    seen_before = set(harness.seen_main_pids)
    instance = asyncio.run(
        harness.runtime.restart(NAME, drain_timeout_s=DRAIN_S, ready_timeout_s=READY_S)
    )
    assert instance.main_pid is not None
    assert instance.main_pid not in seen_before
    if harness.kind == "local":  # its restart stopped what the killed server left
        assert not [ref.pid for ref in harness.orphans if is_alive(ref)]
    assert _main_ref(harness).pid == instance.main_pid
    assert httpx.get(f"{instance.url}/health", timeout=10.0).status_code == 200
    reply = asyncio.run(_complete(instance.url, max_tokens=3))
    assert reply["usage"]["completion_tokens"] == 3


def test_stop_drains_in_flight_requests_and_leaves_no_process(harness: Harness) -> None:
    harness.hold()  # process: the supervisor must not start it again behind our back
    (instance,) = harness.runtime.instances()
    refs = [info.ref for pid in instance.pids if (info := read_proc(pid)) is not None]
    assert refs

    async def request_during_stop() -> tuple[tuple[dict, str], StopResult]:
        first_token = asyncio.Event()
        request = asyncio.create_task(_stream(instance.url, 16, first_token))
        await asyncio.wait_for(first_token.wait(), 60.0)  # the request is running now
        result = await harness.runtime.stop(NAME, drain_timeout_s=DRAIN_S)
        return await request, result

    (usage, finish), result = asyncio.run(request_during_stop())
    # vLLM drained: the request that was running when SIGTERM came finished in full.
    assert (usage["completion_tokens"], finish) == (16, "length")
    assert result.was_running and result.drained, result
    assert not [ref.pid for ref in refs if is_alive(ref)]
    status = harness.runtime.status(NAME)
    assert status.state == ("exited" if harness.kind == "local" else "missing"), status
    assert harness.runtime.instances()[0].pids == frozenset()


async def _stream(url: str, max_tokens: int, first_token: asyncio.Event) -> tuple[dict, str]:
    """A streamed completion; sets `first_token` at the first chunk; (usage, finish reason)."""
    usage, finish = None, None
    async with httpx.AsyncClient(timeout=120.0) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": [1, 2, 3],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("choices"):
                    first_token.set()
                    finish = chunk["choices"][0].get("finish_reason") or finish
                usage = chunk.get("usage") or usage
    assert usage is not None and finish is not None
    return usage, finish
