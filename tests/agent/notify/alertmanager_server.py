"""A real Alertmanager (Debian's `prometheus-alertmanager`) on a free loopback port."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from kvpilot.rig.server import free_port

BINARY_NAMES = ("prometheus-alertmanager", "alertmanager")
CONFIG = """\
route:
  receiver: blackhole
receivers:
  - name: blackhole
"""


def find_binary() -> str | None:
    for name in BINARY_NAMES:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


class AlertmanagerServer:
    """Starts Alertmanager in its own process group; `stop()` ends the whole group."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._log = workdir / "alertmanager.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float = 60.0) -> None:
        config = self.workdir / "alertmanager.yml"
        config.write_text(CONFIG)
        argv = [
            self.binary,
            f"--config.file={config}",
            f"--storage.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--cluster.listen-address=",
        ]
        with self._log.open("wb") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"alertmanager exited: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"alertmanager not ready in {ready_timeout_s} s: {self.log_tail()}")

    def alerts(self) -> list[dict]:
        """Alertmanager's own view: `GET /api/v2/alerts` (active ones; resolved ones leave)."""
        response = httpx.get(f"{self.url}/api/v2/alerts", timeout=5.0)
        response.raise_for_status()
        return response.json()

    def log_tail(self, lines: int = 20) -> str:
        if not self._log.exists():
            return ""
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait(timeout=timeout_s)
