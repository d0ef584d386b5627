"""Runs `kvpilot run --config` as a real process for end-to-end tests, and reads it back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from kvpilot.collectors.procfs import list_processes, read_environ
from kvpilot.rig.server import (
    ServerSpec,
    build_argv,
    free_kvpool_port,
    free_port,
    live_group_members,
)
from kvpilot.tuner.load.generator import LengthDist, LoadReport, Workload, run_load

T = TypeVar("T")
TOKEN = "e2e-control-token"
# Every process of a test's server carries its served model name here (the runtime keeps the
# environment readable in /proc): what a test leaves behind is found even once renamed.
SERVER_ENV = "KVPILOT_E2E_SERVER"


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float, poll_s: float = 0.5) -> T:
    """Poll until `probe` returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            last_error = exc
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}: {last_error!r}")


def instance_argv(spec: ServerSpec) -> list[str]:
    """The vLLM argv of the rig's server, as a kvpilot config lists it."""
    return build_argv(spec)


def agent_config(
    tmp: Path,
    *,
    spec: ServerSpec,
    rules: dict[str, Any],
    notifiers: list[dict[str, Any]],
    remediation: dict[str, Any],
    listen_port: int,
) -> Path:
    config = {
        "listen": {"host": "127.0.0.1", "port": listen_port},
        "api": {"token": TOKEN},
        "interval_s": 1.0,
        "state_dir": str(tmp / "state"),
        "runtime": {
            "kind": "local",
            "drain_timeout_s": 15,
            "ready_timeout_s": 300,
            "instances": [
                {
                    "name": "vllm",
                    "role": "stable",
                    "argv": instance_argv(spec),
                    "env": {
                        "HF_HUB_OFFLINE": "1",
                        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                        SERVER_ENV: spec.served_model_name,
                    },
                    "kvpool_port": spec.kvpool_port,
                    "log_dir": str(tmp / "logs"),
                    "cpus": list(spec.cpus),
                }
            ],
        },
        "rules": rules,
        "notifiers": notifiers,
        "remediation": remediation,
    }
    path = tmp / "kvpilot.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class AgentProcess:
    """`kvpilot run --config` in its own process group, its JSON logs in a file."""

    def __init__(self, config: Path, listen_port: int, log_path: Path) -> None:
        self.config = config
        self.port = listen_port
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> AgentProcess:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvpilot.agent", "run", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "KVPILOT_CONFIG": ""},
            )
        wait_for("the agent's /healthz", self._healthy, 60)
        return self

    def _healthy(self) -> bool:
        assert self.process is not None and self.process.poll() is None, self.log_tail()
        return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/api/v1/status", timeout=5).json()

    def target(self) -> dict[str, Any]:
        return self.status()["targets"][0]

    def main_pid(self) -> int | None:
        return self.target()["main_pid"]

    def collector_up(self, source: str, server: str = "vllm") -> bool:
        line = f'kvpilot_collector_up{{role="stable",server="{server}",source="{source}"}} 1.0'
        return line in self.metrics().splitlines()

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def logs(self) -> list[dict[str, Any]]:
        entries = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                entries.append(json.loads(line))
        return entries

    def started(self, instance: str = "vllm") -> bool:
        """Whether the runtime has said the instance started (ready and probed): before
        that, a server that exits ends `kvpilot run`, however well its /metrics answers."""
        said = f"instance {instance} started"
        return any(e.get("message") == said for e in self.logs())

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL the agent alone: the servers it started live on in their own sessions."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self, timeout_s: float = 120) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        return self.process.returncode


def server_processes(marker: str) -> list[int]:
    """Live processes of the server whose `SERVER_ENV` is `marker` (engines and workers too)."""
    return sorted(
        info.pid
        for info in list_processes().values()
        if info.alive and (read_environ(info.pid) or {}).get(SERVER_ENV) == marker
    )


def kill_servers_of(argv_marker: str) -> None:
    """Last-resort clean-up: kill vLLM groups whose command line holds `argv_marker`, and
    every process marked as that server's (an engine whose API server was killed)."""
    for pid in server_processes(argv_marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for proc in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmdline = proc.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if argv_marker in cmdline and "vllm.entrypoints" in cmdline:
            pid = int(proc.parent.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            for _ in range(100):
                if not live_group_members(pid):
                    break
                time.sleep(0.1)


def control(agent: AgentProcess, path: str, body: dict[str, Any], token: str | None = TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{agent.url}{path}", json=body, headers=headers, timeout=5)


def server_spec(**overrides: Any) -> ServerSpec:
    base = {"port": free_port(), "kvpool_port": free_kvpool_port(), "shutdown_timeout_s": 5}
    return ServerSpec(**{**base, **overrides})


def burst_in_background(url: str, model: str) -> tuple[threading.Thread, list[LoadReport]]:
    """48 requests of 200-300 prompt tokens and 120 output tokens at once, from a thread:
    against 63 usable blocks of 32 tokens they preempt heavily. The report lands in the list."""
    reports: list[LoadReport] = []
    workload = Workload(
        num_requests=48,
        concurrency=48,
        prompt_len=LengthDist.uniform(200, 300),
        output_len=LengthDist.fixed(120),
        seed=11,
        request_timeout_s=240,
    )

    def run() -> None:
        reports.append(asyncio.run(run_load(url, workload, model=model)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, reports
