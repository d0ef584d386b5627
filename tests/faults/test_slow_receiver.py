"""One slow receiver, or one slow alert, holds up no other alert.

A real agent watches three stand-in servers whose /metrics say the KV cache is saturated, so
three alerts fire at once. The webhook receiver answers alert A's notifications only after
8 s and the others at once: the others arrive promptly, and A still arrives.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

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

SLOW_S = 8.0
SATURATED = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="standin"} 0.99
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="standin"} 4
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="standin"} 8
"""


class SlowForOne(ServedInThread):
    """Answers 200 at once, except for the alerts of instance `slow`: after SLOW_S."""

    def __init__(self, slow: str) -> None:
        self.arrived: dict[str, float] = {}  # instance -> when its first request came
        self.accepted: dict[str, float] = {}  # instance -> when it was first answered 200
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                (alert,) = body["alerts"]
                instance = alert["labels"]["instance"]
                with lock:
                    receiver.arrived.setdefault(instance, time.monotonic())
                if instance == slow:
                    time.sleep(SLOW_S)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                with lock:
                    receiver.accepted.setdefault(instance, time.monotonic())

            def log_message(self, *args: object) -> None:
                """Quiet."""

        super().__init__(Handler)


def test_a_slow_alert_does_not_hold_up_the_others(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.prom"
    metrics.write_text(SATURATED)
    names = ("a", "b", "c")
    instances = [standin_instance(tmp_path, n, free_port(), metrics=metrics) for n in names]
    try:
        with SlowForOne(slow="a") as receiver:
            config = base_config(tmp_path, instances, rules={"kv_saturation": {"for_s": 0}})
            config["notifiers"] = [
                {
                    "kind": "webhook",
                    "name": "oncall",
                    "timeout_s": SLOW_S + 5,
                    "url": f"http://127.0.0.1:{receiver.port}/hook",
                }
            ]
            path = write_config(tmp_path / "kvpilot.yaml", config)
            with Agent("run", "--config", str(path)) as agent:
                wait_until(lambda: "a" in receiver.arrived, 30, "alert a's first notification")
                first_s = receiver.arrived["a"]
                wait_until(lambda: {"b", "c"} <= set(receiver.accepted), SLOW_S + 10, "b's and c's")
                for name in ("b", "c"):
                    late_s = receiver.accepted[name] - first_s
                    assert late_s < SLOW_S / 2, f"{name} waited {late_s:.1f} s behind a"
                wait_until(lambda: "a" in receiver.accepted, SLOW_S + 10, "a, in the end")
                agent.check_alive("while delivering")
                agent.signal(signal.SIGTERM)
                assert agent.wait(30) == 0
        assert processes_with(str(tmp_path)) == []  # the servers it started, stopped
    finally:
        kill_all(processes_with(str(tmp_path)))
