"""`kvpilot tune` on the pod runtime, against the fake API server (a fake: no API server
runs here): the plan from the Deployment's flags, a held Lease and a 403 as plain errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from typer.testing import CliRunner

from kvpilot.agent.cli.main import app
from kvpilot.agent.runtimes.kubernetes.lease import DeploymentLease
from tests.agent.k8s.conftest import NAMESPACE, base_deployment

TINY = Path(__file__).resolve().parents[3] / "rig" / "models" / "tiny-llama"


def pod_yaml(fake, tmp_path: Path) -> Path:
    path = tmp_path / "kvpilot.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "runtime": {
                    "kind": "pod",
                    "port": 8000,
                    "model_config": str(TINY),
                    "kubernetes": {
                        "namespace": NAMESPACE,
                        "deployment": "vllm",
                        "api_url": fake.host,
                    },
                },
                "tuning": {"trials": 2, "memory_knob": "kv_cache_memory_bytes"},
            }
        )
    )
    return path


def tune(*args: str) -> Any:
    return CliRunner().invoke(app, ["tune", *args], env={"COLUMNS": "200", "POD_NAME": "pod-a"})


def test_dry_run_plans_from_the_deployments_flags(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))

    result = tune("--config", str(pod_yaml(fake, tmp_path)), "--dry-run")

    assert result.exit_code == 0, result.output
    assert "0 past trials told" in result.output
    assert "1. " in result.output and "2. " in result.output
    assert "kv_cache_memory_bytes=" in result.output
    assert fake.writes() == []  # a plan changes nothing


def test_a_lease_held_by_another_pod_is_a_plain_error(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    DeploymentLease(
        fake.api_client(), namespace=NAMESPACE, deployment="vllm", identity="pod-b"
    ).acquire()

    result = tune("--config", str(pod_yaml(fake, tmp_path)))

    assert result.exit_code == 1
    assert "held by 'pod-b'" in result.output and "Traceback" not in result.output
    assert [w for w in fake.writes() if "deployments" in w.path] == []


def test_a_refused_read_names_the_role(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    fake.forbid("get", "deployments")

    result = tune("--config", str(pod_yaml(fake, tmp_path)), "--dry-run")

    assert result.exit_code == 1
    assert "may not 'get' deployments.apps" in result.output
    assert "the Role 'kvpilot' grants it" in result.output


def test_the_study_holds_the_stable_servers_vllm_version(fake, tmp_path) -> None:
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Version(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"version": "0.32.0"}).encode()
            self.send_response(200 if self.path == "/version" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Version)
    port = server.server_address[1]
    fake.add_deployment(base_deployment(port))
    path = pod_yaml(fake, tmp_path)
    data = yaml.safe_load(path.read_text())
    data["runtime"]["port"] = port
    path.write_text(yaml.safe_dump(data))

    def study() -> str:
        result = tune("--config", str(path), "--dry-run")
        assert result.exit_code == 0, result.output
        return next(line for line in result.output.splitlines() if line.startswith("study "))

    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        known = study()
    finally:
        server.shutdown()
        server.server_close()
    assert study() != known  # refused: the study without the version, another fingerprint
