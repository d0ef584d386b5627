"""`kvpilot` as a subprocess for the fault tests: started in its own process group, read
through its HTTP surface and /proc, always stopped. Nothing here imports kvpilot, so the
same tests can drive any version of the command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


@dataclass(frozen=True)
class Agent:
    """A running `kvpilot run`: its base URL, its process and its log."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def metrics(self) -> str:
        try:
            return httpx.get(f"{self.url}/metrics", timeout=2.0).text
        except httpx.HTTPError:
            return ""

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def proc_status_kib(self, field: str) -> int:
        """A memory line of /proc/<pid>/status (VmRSS, VmHWM), in KiB."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} in /proc/{self.process.pid}/status")

    def wait_for(self, what: str, test: object, deadline_s: float = 40.0) -> str:
        """/metrics once `test(text)` holds; fails with the log when it never does."""
        assert callable(test)
        end = time.monotonic() + deadline_s
        text = ""
        while time.monotonic() < end:
            if self.process.poll() is not None:
                pytest.fail(f"the agent exited ({self.process.returncode}):\n{self.log_tail()}")
            text = self.metrics()
            if text and test(text):
                return text
            time.sleep(0.2)
        memory = ", ".join(f"{f} {self.proc_status_kib(f) // 1024} MiB" for f in ("VmRSS", "VmHWM"))
        pytest.fail(
            f"{what} within {deadline_s:g} s ({memory}); last /metrics:\n"
            f"{text[:3000]}\nlog:\n{self.log_tail()}"
        )


@contextmanager
def kvpilot(args: Sequence[str], folder: Path, port: int) -> Iterator[Agent]:
    """`python -m kvpilot.agent ARGS` listening on `port`; SIGTERM, then SIGKILL, on exit."""
    log = folder / "agent.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvpilot.agent", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=folder,
        )
    try:
        yield Agent(f"http://127.0.0.1:{port}", process, log)
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """Ends the process group: SIGTERM, and SIGKILL when it does not go in time."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=5)


def value(text: str, name: str, **labels: str) -> float | None:
    """The first sample of `name` whose labels include `labels`."""
    for line in text.splitlines():
        if not line.startswith((name + "{", name + " ")):
            continue
        if all(f'{key}="{val}"' in line for key, val in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def ticks(text: str) -> float:
    return value(text, "kvpilot_ticks_total") or 0.0
