"""What the state fault tests run the agent against: a recorded vLLM on loopback that can be
switched between calm and saturated, and the firing notifications a real receiver got."""

from __future__ import annotations

import json
import re
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from tests.agent.notify.notify_receiver import Receiver
from tests.http_helpers import ServedInThread

ROOT = Path(__file__).resolve().parents[3]
SATURATED = (ROOT / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom").read_bytes()
# The same server with half its KV cache free: the saturation rule holds no alert.
CALM = re.sub(rb"(vllm:kv_cache_usage_perc\{[^}]*\}) \S+", rb"\1 0.5", SATURATED)
SATURATION_ALERT = "VllmKvCacheSaturated"


class LoopbackVllm(ServedInThread):
    """A recorded vLLM 0.32 `/metrics` (under load, 7 requests waiting) on loopback, with its
    KV usage at 0.5 until `saturate()` puts it back at 0.995."""

    def __init__(self) -> None:
        self.payload = CALM
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = {
                    "/metrics": server.payload,
                    "/health": b"",
                    "/version": b'{"version": "0.32.0"}',
                }.get(self.path)
                self.send_response(404 if body is None else 200)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: object) -> None:
                """Quiet."""

        super().__init__(Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def saturate(self) -> None:
        self.payload = SATURATED


def firing_notifications(receiver: Receiver, alertname: str) -> list[dict[str, Any]]:
    """Every firing alert of `alertname` in the webhook payloads the receiver accepted."""
    found = []
    for request in receiver.accepted():
        for alert in json.loads(request.body).get("alerts", []):
            if alert.get("status") == "firing" and alert["labels"].get("alertname") == alertname:
                found.append(alert)
    return found


def agent_config(
    state_dir: Path, *, vllm_url: str, receiver_url: str, listen_port: int, interval_s: float = 0.5
) -> dict[str, Any]:
    """`kvpilot run`'s configuration: one server watched by URL, the saturation rule alone
    (firing on the first tick it holds), one webhook."""
    disabled = {"enabled": False}
    return {
        "listen": {"host": "127.0.0.1", "port": listen_port},
        "interval_s": interval_s,
        "state_dir": str(state_dir),
        "runtime": {"kind": "attach", "servers": [{"name": "vllm", "url": vllm_url}]},
        "rules": {
            "kv_saturation": {"for_s": 0},
            "fragmentation": {"kv_blocks": disabled, "allocator": disabled},
            "preemption_spike": disabled,
            "server_down": disabled,
            "engine_stall": disabled,
            "gpu_memory_growth": disabled,
            "gpu_neighbour_pressure": disabled,
        },
        "notifiers": [{"kind": "webhook", "url": f"{receiver_url}/hook", "timeout_s": 2}],
    }
