"""A real Prometheus (Debian's package) in a temporary folder, and its HTTP query API."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvpilot.rig.server import free_port

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    job: str
    address: str  # host:port
    # The target's own labels (as service discovery gives them) and whether the scraped
    # series' labels win over them (a ServiceMonitor's honorLabels).
    labels: Mapping[str, str] = field(default_factory=dict)
    honor_labels: bool = False


class PrometheusServer:
    """Scrapes the targets every second and evaluates `rules_file` every second."""

    def __init__(self, folder: Path, targets: list[ScrapeTarget], rules_file: Path | None) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / "prometheus.log"
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [_scrape_config(t) for t in targets],
        }
        if rules_file is not None:
            config["rule_files"] = [str(rules_file)]
        self.config_path = folder / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, deadline_s: float = 60.0) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(
            lambda: self._ready(),
            deadline_s,
            lambda: f"Prometheus not ready; log:\n{self.log_tail()}",
        )

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"Prometheus exited; log:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def api(self, path: str, params: Mapping[str, str | float]) -> dict[str, Any]:
        """GET an API path; returns the whole JSON answer (status, data or error)."""
        response = httpx.get(f"{self.url}/api/v1/{path}", params=dict(params), timeout=30)
        return response.json()

    def instant(self, expr: str) -> list[dict[str, Any]]:
        answer = self.api("query", {"query": expr})
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]


def _scrape_config(target: ScrapeTarget) -> dict[str, Any]:
    static: dict[str, Any] = {"targets": [target.address]}
    if target.labels:
        static["labels"] = dict(target.labels)
    config: dict[str, Any] = {"job_name": target.job, "static_configs": [static]}
    if target.honor_labels:
        config["honor_labels"] = True
    return config


def wait_for(
    condition: Callable[[], Any], deadline_s: float, why: Callable[[], str], every_s: float = 0.5
) -> Any:
    """Poll `condition` until it returns something true; fail with `why()` at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(why())
        time.sleep(every_s)
