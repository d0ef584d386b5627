"""A server's addresses are read from the runtime every tick: a canary first listed with no
URL (its pod not yet scheduled) is scraped once it has one, and a kvpool port learned after
start-up is read, with the server's windows and counts kept."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import ClassVar

from kvpilot.agent.app.parts import tick_settings
from kvpilot.agent.config import validate_config
from kvpilot.agent.model import Instance
from kvpilot.agent.tasks import GuardedTasks
from kvpilot.agent.tick.watched import WatchedServers
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.nvml import NvmlCollector
from kvpilot.collectors.vllm_metrics import VllmScrape
from tests.http_helpers import ServedInThread

ROOT = Path(__file__).resolve().parents[3]
PAYLOAD = (ROOT / "tests" / "fixtures" / "vllm" / "v0_32_idle.prom").read_bytes()


class _Vllm(BaseHTTPRequestHandler):
    """A recorded vLLM `/metrics`; every path asked for is remembered."""

    asked: ClassVar[list[str]] = []
    lock: ClassVar[threading.Lock] = threading.Lock()

    def do_GET(self) -> None:
        with self.lock:
            self.asked.append(self.path)
        body = PAYLOAD if self.path == "/metrics" else b"not here"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_late_url_and_a_late_kvpool_port_are_read(tmp_path: Path) -> None:
    config = validate_config(
        {
            "state_dir": str(tmp_path),
            "runtime": {"kind": "attach", "servers": [{"name": "canary", "url": "http://x:1"}]},
        },
        warn=False,
    )
    unscheduled = Instance(
        name="canary",
        role="canary",
        url="",
        kvpool_url=None,
        pids=frozenset(),
        main_pid=None,
        argv=None,
        started_at_wall_s=None,
    )

    async def scenario(port: int) -> None:
        watched = WatchedServers(tick_settings(config), NvmlCollector())
        tasks = GuardedTasks()
        try:
            (first,) = await watched.observe([unscheduled], tasks)
            assert isinstance(first.snapshot.vllm, SourceError)

            scheduled = dataclasses.replace(unscheduled, url=f"http://127.0.0.1:{port}")
            (second,) = await watched.observe([scheduled], tasks)
            assert isinstance(second.snapshot.vllm, VllmScrape)
            assert second.snapshot.kvpool is None

            kvpool_url = f"http://127.0.0.1:{port}/kvpool/metrics"
            found = dataclasses.replace(scheduled, kvpool_url=kvpool_url)
            (third,) = await watched.observe([found], tasks)
            assert third.snapshot.kvpool is not None
            assert "/kvpool/metrics" in _Vllm.asked
            assert third.ticker is first.ticker  # one server: its windows and counts stay
            assert third.ticker.state.ticks_total == 3
        finally:
            await watched.aclose()

    with ServedInThread(_Vllm) as served:
        asyncio.run(scenario(served.port))
