"""Secrets never leak: known secrets are configured everywhere a user can put one, and every
channel the agent writes to is searched for them.

The live channels come from a real `kvpilot run --config`: the `local` runtime starts a
stand-in vLLM process (`tests/agent/runtimes/vllm_stub.py` as a `vllm` executable, vLLM's
command line with `--api-key`, a recorded `/metrics` payload), a KV-saturation alert fires
at once, and every notifier posts to a loopback receiver that fails and echoes the request
line and tenant back, as proxies and multi-tenant gateways do. The stored channels are
written through the code paths the tuner, the remediator and the API use, on the state
directory the agent left; the report is `kvpilot tune report`; the Kubernetes patch is a
recommend-only promotion against the fake API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvpilot.collectors.procfs import list_processes
from kvpilot.rig.server import free_port
from tests.http_helpers import ServedInThread

# Each test starts the agent as a process: the inner loop (-m "not slow") skips them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "tests" / "agent" / "runtimes" / "vllm_stub.py"
PAYLOAD = ROOT / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom"

ARGV_API_KEY = "sk-argv-key-5f1c2e"
RUNTIME_API_KEY = "sk-runtime-key-7a9d3b"
ENV_TOKEN = "hf-env-token-0a5b7c"
WEBHOOK_TOKEN = "wh-query-token-91c4e8"
HMAC_SECRET = "hmac-secret-2b6f0d"
WEBHOOK_HEADER = "wh-header-value-6e2d94"
AM_PASSWORD = "am-password-8e3a1c"
AM_TENANT = "tenant-secret-4d7b29"
SLACK_PATH = "/services/T0SECRET1/B0SECRET2/slack-path-token-6c0e5a"
CONTROL_TOKEN = "control-token-3f8e71"
SECRETS = {
    "the vLLM --api-key in argv": ARGV_API_KEY,
    "runtime.api_key": RUNTIME_API_KEY,
    "a secret-named env variable": ENV_TOKEN,
    "the webhook's query token": WEBHOOK_TOKEN,
    "the webhook's hmac_secret": HMAC_SECRET,
    "a webhook header value": WEBHOOK_HEADER,
    "the Alertmanager basic-auth password": AM_PASSWORD,
    "the Alertmanager tenant header": AM_TENANT,
    "the Slack webhook path": SLACK_PATH,
    "the Slack webhook token": SLACK_PATH.rsplit("/", 1)[1],
    "the control API token": CONTROL_TOKEN,
}


def leaks(data: str | bytes) -> list[str]:
    """Which of the configured secrets `data` shows."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return [what for what, secret in SECRETS.items() if secret in text]


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, log: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            found = probe()
            if found:
                return found
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; the agent's log:\n{tail}")


class _EchoingReceiver(BaseHTTPRequestHandler):
    """Refuses every POST with 503, repeating the request line and the tenant back."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = f"upstream unavailable for POST {self.path}"
        tenant = self.headers.get("X-Scope-OrgID")
        if tenant:
            body += f" (tenant {tenant})"
        data = body.encode()
        self.send_response(503)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def stub_executable(folder: Path) -> Path:
    """The stand-in vLLM as an executable named `vllm`: argv `[.../vllm, serve, MODEL, ...]`."""
    path = folder / "bin" / "vllm"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n" + STUB.read_text())
    path.chmod(0o755)
    return path


def instance_argv(stub: Path, port: int) -> list[str]:
    return [
        str(stub),
        "serve",
        "m",
        "--port",
        str(port),
        "--api-key",
        ARGV_API_KEY,
        "--max-num-seqs",
        "8",
    ]


def agent_config(folder: Path, *, stub: Path, vllm_port: int, receiver: int) -> dict[str, Any]:
    base = f"http://127.0.0.1:{receiver}"
    return {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "api": {"token": CONTROL_TOKEN},
        "interval_s": 0.5,
        "state_dir": str(folder / "state"),
        "runtime": {
            "kind": "local",
            "api_key": RUNTIME_API_KEY,
            "ready_timeout_s": 30,
            "drain_timeout_s": 5,
            "instances": [
                {
                    "name": "vllm",
                    "argv": instance_argv(stub, vllm_port),
                    "env": {"STUB_METRICS_FILE": str(PAYLOAD), "HF_TOKEN": ENV_TOKEN},
                    "log_dir": str(folder / "logs"),
                }
            ],
        },
        "rules": {"kv_saturation": {"for_s": 0}},
        "remediation": {"dry_run": True},
        "notifiers": [
            {
                "kind": "webhook",
                "url": f"{base}/alerts?token={WEBHOOK_TOKEN}",
                "hmac_secret": HMAC_SECRET,
                "headers": {"X-Auth-Token": WEBHOOK_HEADER},
            },
            {
                "kind": "alertmanager",
                "url": base,
                "auth": {"username": "kvpilot", "password": AM_PASSWORD},
                "headers": {"X-Scope-OrgID": AM_TENANT},
            },
            {"kind": "slack", "url": f"{base}{SLACK_PATH}"},
        ],
    }


@dataclass
class LiveRun:
    """What the agent served and wrote while it ran, and where its files are."""

    folder: Path
    config_path: Path
    config: dict[str, Any]
    metrics: str
    status: str
    alerts: str
    log: str


def run_agent(folder: Path, env: dict[str, str] | None = None) -> LiveRun:
    """`kvpilot run --config` until the live flags show, an alert fired and every notifier's
    delivery failed; then stopped with SIGTERM. `env` runs it with another environment."""
    stub = stub_executable(folder)
    with ServedInThread(_EchoingReceiver) as receiver:
        config = agent_config(folder, stub=stub, vllm_port=free_port(), receiver=receiver.port)
        path = folder / "kvpilot.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        url = f"http://127.0.0.1:{config['listen']['port']}"
        log_path = folder / "agent.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvpilot.agent", "run", "--config", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=folder,
                start_new_session=True,
                env={**(env or os.environ), "KVPILOT_CONFIG": ""},
            )
        servers: list[int] = []
        try:

            def target() -> dict[str, Any]:
                assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
                status = httpx.get(f"{url}/api/v1/status", timeout=2).json()
                found = status["targets"][0]
                if found.get("main_pid"):
                    servers.append(found["main_pid"])
                return found if found["state"] == "running" else {}

            def failed_everywhere() -> bool:
                text = log_path.read_text(errors="replace")
                lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
                failed = {e.get("notifier") for e in lines if "delivery: failed" in e["message"]}
                return failed >= {"webhook", "alertmanager", "slack"}

            wait_for("the stand-in vLLM to run", target, 40, log_path)
            metrics = wait_for(
                "the live flags on /metrics",
                lambda: (
                    (t := httpx.get(f"{url}/metrics", timeout=2).text)
                    and "kvpilot_live_flags_info{" in t
                    and t
                ),
                30,
                log_path,
            )
            wait_for("a failed delivery on every notifier", failed_everywhere, 40, log_path)
            status = httpx.get(f"{url}/api/v1/status", timeout=5).text
            alerts = httpx.get(f"{url}/api/v1/alerts", timeout=5).text
            assert "firing" in alerts, alerts
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=10)
            # The stand-in leads its own process group; found by its path if never listed.
            mine = {i.pid for i in list_processes().values() if str(stub) in i.argv[:2]}
            for pid in set(servers) | mine:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
    return LiveRun(folder, path, config, metrics, status, alerts, log_path.read_text())


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> LiveRun:
    return run_agent(tmp_path_factory.mktemp("secrets"))


def test_metrics_show_that_a_key_is_set_but_not_the_key(live: LiveRun) -> None:
    assert leaks(live.metrics) == []
    (flags,) = [x for x in live.metrics.splitlines() if x.startswith("kvpilot_live_flags_info{")]
    assert "--api-key ***" in flags and "--max-num-seqs 8" in flags


def test_status_and_alerts_show_no_secret(live: LiveRun) -> None:
    assert leaks(live.status) == []
    assert leaks(live.alerts) == []
    target = json.loads(live.status)["targets"][0]
    assert target["live_flags"][-4:] == ["--api-key", "***", "--max-num-seqs", "8"]


def test_the_log_file_shows_no_secret_in_any_field(live: LiveRun) -> None:
    entries = [json.loads(x) for x in live.log.splitlines() if x.startswith("{")]
    failed = [e for e in entries if "delivery: failed" in e["message"]]
    assert {e["notifier"] for e in failed} >= {"webhook", "alertmanager", "slack"}
    # The receivers' answers are kept, their secrets masked.
    assert any("/alerts?token=***" in e["error"] for e in failed), failed
    assert leaks(live.log) == []


@pytest.fixture(scope="module")
def stored(live: LiveRun) -> LiveRun:
    """The run's state directory with a promotion, a rollout and its trial and an audit row
    added through the product's own paths, as the tuner and the remediator write them."""
    from kvpilot.agent.app.parts import tuned_server
    from kvpilot.agent.config import load_config
    from kvpilot.agent.runtimes.local import LocalRuntime
    from kvpilot.agent.state import StateStore
    from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
    from kvpilot.agent.tuning.local.factory import local_adapter
    from kvpilot.agent.tuning.promoted import yaml_hash
    from kvpilot.tuner.rollout.canary import Phase, RolloutRecord, Strategy
    from kvpilot.tuner.trials import TrialState, new_trial

    config = load_config(live.config_path)
    sha = yaml_hash(live.config_path)
    configured = tuple(live.config["runtime"]["instances"][0]["argv"])
    candidate = (*configured[:-1], "16")
    now = time.time()

    async def restarted(argv: tuple[str, ...], reason: str, restore: bool) -> None:
        return None

    with StateStore.open(config.state_dir) as store:
        runtime = LocalRuntime([], config.state_dir / "logs")
        adapter = local_adapter(
            tuned_server(config),
            runtime,
            store.db,
            tuning=config.tuning,
            log_dir=config.state_dir / "logs",
            config_sha256=sha,
            restart_stable=restarted,
        )
        asyncio.run(adapter.set_stable(candidate, reason="trial 1", ready_timeout_s=1.0))
        journal, trials = SqliteRolloutJournal(store.db), SqliteTrialStore(store.db)
        record = RolloutRecord(
            "t-1", Strategy.SEQUENTIAL, Phase.PLANNED, configured, candidate, now
        )
        journal.save(record)
        trial = new_trial("t-1", "study", 1, {"max_num_seqs": 16}, now)
        trials.add(trial)
        why = f"not switched to the candidate: cannot run {shlex.join(candidate)}"
        trials.save(trial.to(TrialState.ABORTED, at_wall_s=now, reason=why))
        journal.save(record.at(Phase.ABORTED, at_wall_s=now, reason=why))
        store.record_audit(
            wall_s=now,
            actor="agent",
            action="tune",
            target="vllm",
            decision="failed",
            reason=why,
            details={"argv": list(candidate), "requested_by": "schedule"},
        )
    return live


def test_the_state_file_holds_no_secret(stored: LiveRun) -> None:
    from kvpilot.agent.app.compose import promoted_argv
    from kvpilot.agent.config import load_config
    from kvpilot.agent.state import StateStore
    from kvpilot.agent.tuning.promoted import yaml_hash

    live = stored
    state = live.folder / "state"
    files = sorted(p for p in state.iterdir() if p.name.startswith("kvpilot.db"))
    assert files, list(state.iterdir())
    found = {p.name: leaks(p.read_bytes()) for p in files}
    assert found == {p.name: [] for p in files}
    # The promoted flags still run with the server's real key.
    config = load_config(live.config_path)
    with StateStore.open(config.state_dir) as store:
        promoted = promoted_argv(config, store, yaml_hash(live.config_path))
    assert ARGV_API_KEY in promoted["vllm"] and promoted["vllm"][-1] == "16"


def test_the_tuning_report_shows_no_secret(stored: LiveRun) -> None:
    live = stored
    report = live.folder / "report.html"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpilot.agent",
            "tune",
            "report",
            "--config",
            str(live.config_path),
            "--output",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=live.folder,
        env={**os.environ, "KVPILOT_CONFIG": ""},
    )
    assert done.returncode == 0, done.stderr
    html = report.read_text()
    assert "cannot run" in html  # the trial is on the page
    assert leaks(html) == [] and leaks(done.stdout + done.stderr) == []


@pytest.fixture
def k8s_api() -> Iterator[Any]:
    from tests.fakes.k8s_apiserver import FakeKubernetesApi

    with FakeKubernetesApi() as api:
        yield api


def test_a_kubernetes_recommendation_shows_no_secret(k8s_api: Any, tmp_path: Path) -> None:
    from kvpilot.agent.runtimes.kubernetes.runtime import KubernetesRuntime, KubernetesTarget
    from tests.agent.k8s.conftest import NAMESPACE, base_deployment

    body = base_deployment(8000)
    vllm = body["spec"]["template"]["spec"]["containers"][0]
    vllm["args"] = [*vllm["args"], f"--api-key={ARGV_API_KEY}"]
    k8s_api.add_deployment(body)
    target = KubernetesTarget(
        namespace=NAMESPACE, deployment="vllm", promote="recommend", state_dir=tmp_path
    )
    runtime = KubernetesRuntime(target, k8s_api.api_client(), identity="pod-a", poll_s=0.01)
    argv = [*vllm["args"], "--max-num-seqs", "16"]

    promotion = asyncio.run(runtime.promote(argv, ready_timeout_s=5))

    recommendation = promotion.recommendation
    assert recommendation is not None and recommendation.path is not None
    written = recommendation.path.read_text()
    assert leaks(written) == [] and leaks(recommendation.patch) == []
    assert "--api-key=***" in written and "--max-num-seqs" in written
    assert "masked" in recommendation.reason  # whoever applies it is told to fill it in
    # Recommend-only: nothing changed in the cluster; one Event announces the patch, masked.
    (event,) = k8s_api.writes()
    assert (event.method, event.path) == ("POST", f"/api/v1/namespaces/{NAMESPACE}/events")
    assert leaks(json.dumps(event.body)) == [] and "--api-key" not in event.body["message"]
