"""`kvpilot workload show` and `kvpilot tune --dry-run` choosing their workload: observed
from a server's /metrics (a loopback server answering with recorded vLLM bodies), or read
from a sidecar's API (a loopback server answering with what the API serves)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import yaml
from typer.testing import CliRunner

from kvpilot.agent.cli.main import app
from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.tuning.workload.as_json import workload_json
from kvpilot.agent.tuning.workload.window import WorkloadWindow
from kvpilot.rig.server import free_port
from tests.agent.sidecar_harness import agent_config, server_spec
from tests.agent.tuning.workload_scrapes import served
from tests.agent.vllm_bodies import metrics_server, recorded
from tests.http_helpers import ServedInThread, send_json

BODIES = ("v0_32_idle.prom", "v0_32_under_load.prom")


def _config(tmp_path: Path, port: int, learn: dict[str, Any] | None = None) -> Path:
    path = agent_config(
        tmp_path,
        spec=server_spec(port=port),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )
    if learn is not None:
        data = yaml.safe_load(path.read_text())
        data["tuning"] = {"learn": learn}
        path.write_text(yaml.safe_dump(data))
    return path


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def test_show_observes_the_server_and_prints_both(tmp_path: Path) -> None:
    with metrics_server(recorded(*BODIES)) as vllm:
        config = _config(tmp_path, vllm.port, {"min_requests": 50})
        result = _cli("workload", "show", "-c", str(config), "--observe-s", "2")
    assert result.exit_code == 0, result.output
    assert "prompt tokens p50 / p90" in result.output
    assert "384 / 384 (fixed)" in result.output  # the configured workload beside it
    assert "81 in" in result.output  # the learned requests
    assert f"learned: observed at http://127.0.0.1:{vllm.port} for 2 s" in result.output
    assert "a tuning run uses: learned (learned from 81 requests" in result.output


def test_show_as_json_and_below_the_floor(tmp_path: Path) -> None:
    with metrics_server(recorded(*BODIES)) as vllm:
        config = _config(tmp_path, vllm.port)
        result = _cli("workload", "show", "-c", str(config), "--observe-s", "2", "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body["learned"]["requests"] == 81
    assert body["choice"]["source"] == "configured"
    assert "below the floor of 200" in body["choice"]["reason"]


def test_a_server_that_does_not_answer_is_a_reason_not_a_traceback(tmp_path: Path) -> None:
    config = _config(tmp_path, free_port())
    result = _cli("workload", "show", "-c", str(config), "--observe-s", "1")
    assert result.exit_code == 0, result.output
    assert "could not be observed" in result.output
    assert "a tuning run uses: configured (no learned workload: the stable server" in result.output


def _sidecar(body: object, status: int = 200) -> ServedInThread:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/api/v1/workload":
                send_json(self, status, body)
            else:
                self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    return ServedInThread(Handler)


def _learned_body(requests: int) -> dict[str, Any]:
    window = WorkloadWindow(3600)
    window.observe(served(0, at_s=0.0))
    window.observe(served(requests, at_s=100.0))
    return workload_json(TuningConfig(), window.shape(), window.requests())


def test_tune_takes_the_sidecar_s_window_and_says_so(tmp_path: Path) -> None:
    with _sidecar(_learned_body(300)) as sidecar:
        config = _config(tmp_path, free_port())
        url = f"http://127.0.0.1:{sidecar.port}"
        result = _cli("tune", "-c", str(config), "--dry-run", "--sidecar-url", url)
        show = _cli("workload", "show", "-c", str(config), "--sidecar-url", url)
    assert result.exit_code == 0, result.output
    assert "workload: learned (learned from 300 requests over 100 s: prompt 512/512" in (
        result.output
    )
    assert show.exit_code == 0 and f"learned: from the sidecar at {url}" in show.output


def test_tune_without_a_window_uses_the_configured_workload_and_says_why(tmp_path: Path) -> None:
    config = _config(tmp_path, free_port())
    result = _cli("tune", "-c", str(config), "--dry-run")  # no sidecar at the listen address
    assert result.exit_code == 0, result.output
    assert "workload: configured (no learned workload: no sidecar answered at" in result.output
    with _sidecar({"learned": {"prompt_tokens": 3}}) as bad:
        url = f"http://127.0.0.1:{bad.port}"
        garbled = _cli("tune", "-c", str(config), "--dry-run", "--sidecar-url", url)
    assert garbled.exit_code == 0, garbled.output
    assert "sent no workload: the learned shape is malformed" in garbled.output
    with _sidecar({"learned": None, "window": 3}) as empty:
        url = f"http://127.0.0.1:{empty.port}"
        nothing = _cli("workload", "show", "-c", str(config), "--sidecar-url", url)
    assert nothing.exit_code == 0, nothing.output
    assert "has learned nothing yet" in nothing.output
    with _sidecar(_learned_body(300), status=503) as down:
        url = f"http://127.0.0.1:{down.port}"
        refused = _cli("tune", "-c", str(config), "--dry-run", "--sidecar-url", url)
    assert "answered HTTP 503" in refused.output
