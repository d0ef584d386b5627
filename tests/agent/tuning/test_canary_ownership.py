"""Stopping the canary stops the one kvpilot started, also when an earlier kvpilot died and
left it running, and never a process kvpilot did not start, though it look like a vLLM server
on the canary's port.

The servers here are real Python processes with vLLM's command line: a script named `vllm`
(`python .../vllm serve MODEL --port N`) that answers the readiness probe like a server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.agent.runtimes.local import LocalRuntime
from kvpilot.agent.runtimes.processes import find_vllm_mains
from kvpilot.agent.state.db import Database
from kvpilot.agent.tuning.local.adapter import LocalTunerAdapter
from kvpilot.collectors.procfs import list_processes
from kvpilot.rig.server import free_port, live_group_members

STUB_VLLM = """
import json, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])


class Handler(BaseHTTPRequestHandler):
    def _send(self, payload):
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"data": [{"id": "m"}]} if self.path == "/v1/models" else {})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send({"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}})

    def log_message(self, *args):
        pass


try:
    server = HTTPServer(("127.0.0.1", port), Handler)
except OSError:  # the port is taken: stay up without serving
    signal.pause()
server.serve_forever()
"""


@pytest.fixture
def stub(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "vllm"
    path.parent.mkdir()
    path.write_text(STUB_VLLM)
    return path


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    opened = Database.open(tmp_path / "state")
    yield opened
    opened.close()


@pytest.fixture
def groups() -> Iterator[list[int]]:
    """Process groups to kill at the end, whatever the test left running."""
    pgids: list[int] = []
    yield pgids
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _adapter(tmp_path: Path, db: Database, canary_port: int) -> LocalTunerAdapter:
    stable = LocalRuntime([], tmp_path / "logs")  # the stable instance plays no part here
    return LocalTunerAdapter(
        stable,
        stable_name="vllm",
        canary_port=canary_port,
        log_dir=tmp_path / "logs",
        db=db,
        configured_argv=("vllm", "serve", "m"),
        config_sha256="sha",
        drain_timeout_s=5.0,
    )


def _not_ours(stub: Path, port: int, groups: list[int]) -> subprocess.Popen[bytes]:
    """A vLLM-shaped server on `port` that kvpilot did not start (its own session)."""
    argv = [sys.executable, str(stub), "serve", "m", "--port", str(port)]
    process = subprocess.Popen(argv, start_new_session=True)
    groups.append(process.pid)
    return process


def _mains_on(port: int) -> set[int]:
    return {info.pid for info in find_vllm_mains(list_processes(), port=port)}


def test_a_vllm_server_kvpilot_did_not_start_survives_stop_canary(
    tmp_path: Path, db: Database, stub: Path, groups: list[int]
) -> None:
    port = free_port()
    other = _not_ours(stub, port, groups)
    assert _mains_on(port) == {other.pid}  # it looks like a vLLM server on the canary's port
    asyncio.run(_adapter(tmp_path, db, port).stop_canary())
    assert other.poll() is None, "a process kvpilot did not start was killed"


def test_the_canary_a_dead_kvpilot_left_is_stopped_and_nothing_else(
    tmp_path: Path, db: Database, stub: Path, groups: list[int]
) -> None:
    port = free_port()
    # A kvpilot starts a canary, then dies without stopping it (its own session: it lives on).
    dead = _adapter(tmp_path, db, port)
    argv = [sys.executable, str(stub), "serve", "m"]
    assert asyncio.run(dead.start_canary(argv, ready_timeout_s=60.0)) == f"http://127.0.0.1:{port}"
    (canary,) = _mains_on(port)
    groups.append(canary)
    other = _not_ours(stub, port, groups)
    assert _mains_on(port) == {canary, other.pid}
    # The next kvpilot, on the same state, stops what the dead one left.
    asyncio.run(_adapter(tmp_path, db, port).stop_canary())
    assert live_group_members(canary) == []
    assert other.poll() is None, "a process kvpilot did not start was killed"
    assert _mains_on(port) == {other.pid}
