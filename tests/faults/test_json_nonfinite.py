"""NaN and ±Inf from a server never make the JSON API fail: they are rendered as null.

A real `kvpilot run --config` watches loopback servers whose vLLM `/metrics` and kvpool
payloads carry NaN and +Inf; `/api/v1/status` and `/api/v1/alerts` keep answering 200 with
valid JSON, and no non-finite number reaches it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvpilot.rig.server import free_port
from tests.agent.sidecar_harness import AgentProcess, wait_for
from tests.http_helpers import ServedInThread

# Each test starts the agent as a process: the inner loop (-m "not slow") skips them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RECORDED = (ROOT / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom").read_text()
_USAGE = re.compile(r"^(vllm:kv_cache_usage_perc\{[^}]*\}) \S+$", re.MULTILINE)
VLLM_PAYLOAD = _USAGE.sub(r"\1 NaN", RECORDED).encode()

# The in-engine plugin's figures: an allocator fragmentation of +Inf (over the 0.30 rule's
# threshold, so an alert carries it as its value) and a NaN snapshot age.
KVPOOL_PAYLOAD = b"""\
# TYPE kvpool_fragmentation_ratio gauge
kvpool_fragmentation_ratio{device="0",rank="0",source="allocator"} +Inf
# TYPE kvpool_allocator_reserved_bytes gauge
kvpool_allocator_reserved_bytes{device="0",rank="0"} 1073741824
# TYPE kvpool_allocator_free_in_reserved_bytes gauge
kvpool_allocator_free_in_reserved_bytes{device="0",rank="0"} 536870912
# TYPE kvpool_blocks_usable gauge
kvpool_blocks_usable{engine="0",model_name="rig/models/tiny-llama"} 1023
# TYPE kvpool_blocks_free gauge
kvpool_blocks_free{engine="0",model_name="rig/models/tiny-llama"} 400
# TYPE kvpool_snapshot_age_seconds gauge
kvpool_snapshot_age_seconds{engine="0",model_name="rig/models/tiny-llama"} NaN
"""


class _NonFiniteVllm(BaseHTTPRequestHandler):
    """A vLLM whose KV usage is NaN, and its kvpool plugin with +Inf and NaN, on loopback."""

    def do_GET(self) -> None:
        body = {
            "/metrics": VLLM_PAYLOAD,
            "/kvpool/metrics": KVPOOL_PAYLOAD,
            "/health": b"",
            "/version": b'{"version": "0.32.0"}',
        }.get(self.path)
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


class _Kvpool(_NonFiniteVllm):
    """The kvpool plugin's own port: its payload at any path."""

    def do_GET(self) -> None:
        self.path = "/kvpool/metrics"
        super().do_GET()


def _runtime(kind: str, vllm_port: int, kvpool_port: int) -> dict[str, Any]:
    if kind == "attach":
        return {
            "kind": "attach",
            "servers": [
                {
                    "name": "vllm",
                    "url": f"http://127.0.0.1:{vllm_port}",
                    "kvpool_url": f"http://127.0.0.1:{kvpool_port}",
                }
            ],
        }
    return {"kind": "process", "port": vllm_port, "kvpool_port": kvpool_port}


@pytest.fixture(params=["attach", "process"])
def agent(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AgentProcess]:
    with ServedInThread(_NonFiniteVllm) as vllm, ServedInThread(_Kvpool) as kvpool:
        port = free_port()
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "interval_s": 0.3,
            "state_dir": str(tmp_path / "state"),
            "runtime": _runtime(request.param, vllm.port, kvpool.port),
        }
        path = tmp_path / "kvpilot.yaml"
        path.write_text(yaml.safe_dump(config))
        process = AgentProcess(path, port, tmp_path / "agent.log")
        try:
            yield process.start()
        finally:
            process.stop(timeout_s=20)


def _finite_everywhere(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite_everywhere(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite_everywhere(v) for v in value)
    return True


def _strict_json(response: httpx.Response) -> Any:
    """The body as strict JSON: NaN, Infinity and -Infinity are not JSON."""

    def refuse(token: str) -> None:
        raise AssertionError(f"{response.url.path} rendered {token}: {response.text[:300]}")

    return json.loads(response.text, parse_constant=refuse)


def _ticks(agent: AgentProcess) -> int:
    return int(httpx.get(f"{agent.url}/healthz", timeout=5).json()["ticks_total"])


def test_status_and_alerts_render_non_finite_values_as_null(agent: AgentProcess) -> None:
    before = _ticks(agent)
    wait_for("three more ticks", lambda: _ticks(agent) >= before + 3, 20, poll_s=0.1)
    bodies = {}
    for path in ("/api/v1/status", "/api/v1/alerts"):
        response = httpx.get(f"{agent.url}{path}", timeout=5)
        assert response.status_code == 200, response.text[:300]
        assert response.headers["content-type"] == "application/json"
        bodies[path] = _strict_json(response)
        assert _finite_everywhere(bodies[path])
    # The +Inf fragmentation and the NaN KV usage are no figures: their alerts show null
    # (whether the number was refused at the edge or reached the API).
    for body in bodies.values():
        values = {a["rule"]: a["value"] for a in body["alerts"]}
        assert "fragmentation_allocator" in values and values["fragmentation_allocator"] is None
        assert "kv_saturation" in values and values["kv_saturation"] is None
    assert "Traceback" not in agent.log_path.read_text(errors="replace")
