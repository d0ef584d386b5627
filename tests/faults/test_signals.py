"""Signals to a running agent: SIGHUP reloads (or is survived), SIGTERM interrupts a restart.

Real agents (`kvpilot run`), real stand-in server processes, real webhook receivers.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults.running_agent import (
    Agent,
    base_config,
    free_port,
    kill_all,
    processes_with,
    standin_instance,
    wait_until,
    write_config,
)
from tests.http_helpers import ServedInThread

# Each test starts the agent as a process: the inner loop (-m "not slow") skips them.
pytestmark = pytest.mark.slow

TOKEN = "signals-test-token"
SATURATED = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="standin"} 0.99
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="standin"} 4
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="standin"} 8
"""
IDLE = SATURATED.replace("0.99", "0.10").replace("} 4", "} 0")


class Hook(ServedInThread):
    """A webhook receiver that keeps the alert names it was sent."""

    def __init__(self) -> None:
        self.alertnames: list[str] = []
        lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    hook.alertnames += [a["labels"]["alertname"] for a in body["alerts"]]
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                """Quiet."""

        super().__init__(Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"


def _hook(name: str, url: str) -> dict[str, Any]:
    return {"kind": "webhook", "name": name, "url": url, "timeout_s": 5}


def test_sighup_is_survived_when_there_is_nothing_to_reload() -> None:
    port = free_port()
    args = (
        "run",
        "--vllm-url",
        f"http://127.0.0.1:{free_port()}",
        "--listen",
        f"127.0.0.1:{port}",
        "--interval",
        "0.5",
    )
    with Agent(*args) as agent:
        agent.wait_healthy(port)
        agent.signal(signal.SIGHUP)
        agent.wait_message("reload is not supported; restart kvpilot to apply a new configuration")
        agent.wait_healthy(port)
        agent.signal(signal.SIGTERM)
        assert agent.wait(30) == 0


def test_sighup_reloads_notifiers_and_rules_and_refuses_an_invalid_file(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.prom"
    metrics.write_text(IDLE)
    instance = standin_instance(tmp_path, "tiny", free_port(), metrics=metrics)
    with Hook() as old, Hook() as new:
        config = base_config(tmp_path, [instance], rules={"kv_saturation": {"enabled": False}})
        config["notifiers"] = [_hook("oncall", old.url)]
        path = write_config(tmp_path / "kvpilot.yaml", config)
        try:
            with Agent("run", "--config", str(path)) as agent:
                agent.wait_message("instance tiny started")
                config["notifiers"] = [_hook("oncall", new.url)]
                config["rules"] = {"kv_saturation": {"enabled": True, "for_s": 0}}
                write_config(path, config)
                agent.signal(signal.SIGHUP)
                agent.wait_message("configuration reloaded")

                path.write_text(path.read_text().replace('"timeout_s": 5', '"timeout_s": -1'))
                agent.signal(signal.SIGHUP)
                refused = agent.wait_message("reload refused")
                assert "timeout_s" in refused, refused  # the reason, named

                metrics.write_text(SATURATED)  # the reloaded rule fires, to the reloaded hook
                wait_until(lambda: "VllmKvCacheSaturated" in new.alertnames, 20, "the alert at new")
                assert old.alertnames == []
                agent.signal(signal.SIGTERM)
                assert agent.wait(30) == 0
        finally:
            kill_all(processes_with(str(tmp_path)))


def test_sigterm_during_a_restart_interrupts_it(tmp_path: Path) -> None:
    """The new server never becomes ready: shutdown does not wait for it, records the
    remediation interrupted, and leaves no process of the server behind."""
    drain_s = 3.0
    instance = standin_instance(tmp_path, "tiny", free_port(), plan="serve,hang")
    config = base_config(
        tmp_path,
        [instance],
        api={"token": TOKEN},
        remediation={"drain_timeout_s": drain_s, "verify_timeout_s": 300},
    )
    config["runtime"]["drain_timeout_s"] = drain_s
    path = write_config(tmp_path / "kvpilot.yaml", config)
    port = config["listen"]["port"]
    starts = tmp_path / "tiny.starts"
    try:
        with Agent("run", "--config", str(path)) as agent:
            agent.wait_message("instance tiny started")
            answer = httpx.post(
                f"http://127.0.0.1:{port}/api/v1/remediations",
                json={"instance": "tiny", "force": True, "reason": "fault test"},
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=5,
            )
            assert answer.status_code == 202, answer.text
            # Restarted: the second start hangs (with a child) and never becomes ready.
            wait_until(lambda: starts.read_text() == "2", 20, "the second start")
            wait_until(lambda: len(processes_with(str(tmp_path))) >= 2, 20, "its child")
            sent = time.monotonic()
            agent.signal(signal.SIGTERM)
            agent.wait(drain_s + 20)
            elapsed_s = time.monotonic() - sent
        assert elapsed_s < drain_s + 15, f"shutdown took {elapsed_s:.1f} s"
        with sqlite3.connect(tmp_path / "state" / "kvpilot.db") as db:
            state, reason = db.execute(
                "SELECT state, reason FROM remediations ORDER BY id DESC LIMIT 1"
            ).fetchone()
        assert state == "failed" and "interrupted" in reason, (state, reason)
        assert processes_with(str(tmp_path)) == []
    finally:
        kill_all(processes_with(str(tmp_path)))
