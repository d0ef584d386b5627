"""`kvpilot run`, with or without a configuration, takes one tick path: one NVML read per tick
serving every server, its per-call errors counted, and several servers watched by URL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
import yaml

from kvpilot.rig.server import free_port
from tests.http_helpers import ServedInThread

# Each test starts the agent as a process: the inner loop (-m "not slow") skips them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
PAYLOAD = (ROOT / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom").read_bytes()
FAKE_SITE = ROOT / "tests" / "fakes" / "nvml_site"
GIB = 1 << 30
NVML_ERROR_NOT_SUPPORTED = 3


class _RecordedVllm(BaseHTTPRequestHandler):
    """A recorded vLLM `/metrics` payload, `/health` and `/version` on loopback."""

    def do_GET(self) -> None:
        body = {"/metrics": PAYLOAD, "/health": b"", "/version": b'{"version": "0.32.0"}'}.get(
            self.path
        )
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _agent(
    config: dict[str, object], folder: Path, nvml: dict[str, object] | None
) -> Iterator[str]:
    """`kvpilot run --config` in its own process group; yields its base URL."""
    path = folder / "kvpilot.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ)
    if nvml is not None:
        (folder / "nvml.json").write_text(json.dumps(nvml))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKE_SITE), env.get("PYTHONPATH")]))
        env["KVPILOT_FAKE_NVML"] = str(folder / "nvml.json")
    log = (folder / "agent.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvpilot.agent", "run", "--config", str(path)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=folder,
    )
    log.close()
    listen = config["listen"]
    assert isinstance(listen, dict)
    try:
        yield f"http://127.0.0.1:{listen['port']}"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)


def _metrics_after_ticks(url: str, ticks: int, folder: Path, deadline_s: float = 30.0) -> str:
    """The agent's /metrics once it has completed `ticks` ticks."""
    deadline = time.monotonic() + deadline_s
    text = ""
    while time.monotonic() < deadline:
        try:
            text = httpx.get(f"{url}/metrics", timeout=2.0).text
        except httpx.HTTPError:
            text = ""
        for line in text.splitlines():
            if line.startswith("kvpilot_ticks_total ") and float(line.split()[1]) >= ticks:
                return text
        time.sleep(0.2)
    log = (folder / "agent.log").read_text(errors="replace")
    pytest.fail(f"the agent did not complete {ticks} ticks in {deadline_s} s:\n{log[-3000:]}")


def _value(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_nvml_call_errors_are_counted_under_run_config(tmp_path: Path) -> None:
    # One GPU whose utilisation query is not supported: every tick's NVML read records a
    # per-call error, which the agent must count (it used to count another collector's).
    nvml = {
        "gpus": [
            {
                "uuid": "GPU-0",
                "total_bytes": 80 * GIB,
                "used_bytes": 20 * GIB,
                "reserved_bytes": 512 << 20,
                "utilization_gpu_percent": 0,
                "utilization_memory_percent": 0,
                "processes": [],
                "fail": {"nvmlDeviceGetUtilizationRates": NVML_ERROR_NOT_SUPPORTED},
            }
        ]
    }
    with ServedInThread(_RecordedVllm) as vllm:
        config = {
            "listen": {"host": "127.0.0.1", "port": free_port()},
            "interval_s": 0.5,
            "state_dir": str(tmp_path / "state"),
            "runtime": {"kind": "process", "port": vllm.port},
        }
        with _agent(config, tmp_path, nvml) as url:
            text = _metrics_after_ticks(url, 3, tmp_path)
    assert _value(text, "kvpilot_collector_up", source="nvml") == 1.0
    counted = [
        line
        for line in text.splitlines()
        if line.startswith("kvpilot_collector_errors_total{") and 'source="nvml_call"' in line
    ]
    assert counted, "no NVML per-call error was counted:\n" + text[:2000]
    assert "not_supported" in counted[0]
    assert float(counted[0].rsplit(" ", 1)[1]) >= 3


def test_one_agent_watches_several_servers_by_url(tmp_path: Path) -> None:
    with ExitStack() as stack:
        servers = [stack.enter_context(ServedInThread(_RecordedVllm)) for _ in range(3)]
        config = {
            "listen": {"host": "127.0.0.1", "port": free_port()},
            "interval_s": 0.5,
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "attach",
                "servers": [
                    {"name": f"s{i}", "url": f"http://127.0.0.1:{server.port}"}
                    for i, server in enumerate(servers)
                ],
            },
        }
        with _agent(config, tmp_path, None) as url:
            text = _metrics_after_ticks(url, 2, tmp_path)
            alerts = httpx.get(f"{url}/api/v1/status", timeout=5.0)
    for name in ("s0", "s1", "s2"):
        assert _value(text, "kvpilot_collector_up", server=name, source="vllm") == 1.0
        assert _value(text, "kvpilot_kv_usage_ratio", server=name) is not None
    assert alerts.status_code == 200


def test_run_with_a_url_takes_the_sidecar_path(tmp_path: Path) -> None:
    """`kvpilot run --vllm-url` is the sidecar with one attached server: rules and the API
    answer, and nothing is left in the working directory."""
    port = free_port()
    with ServedInThread(_RecordedVllm) as vllm:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvpilot.agent",
                "run",
                "--vllm-url",
                f"http://127.0.0.1:{vllm.port}",
                "--listen",
                f"127.0.0.1:{port}",
                "--interval",
                "0.5",
            ],
            stdout=(tmp_path / "agent.log").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=tmp_path,
        )
        try:
            text = _metrics_after_ticks(f"http://127.0.0.1:{port}", 2, tmp_path)
            status = httpx.get(f"http://127.0.0.1:{port}/api/v1/status", timeout=5.0)
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=20)
    assert _value(text, "kvpilot_collector_up", server="vllm", source="vllm") == 1.0
    assert status.status_code == 200
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.log"]
