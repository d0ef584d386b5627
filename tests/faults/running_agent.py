"""The agent as a real process for the fault tests: its configuration, its logs, its end.

Only the standard library and httpx, never a kvpilot import: the same tests can drive an
older kvpilot (`PYTHONPATH` names which one the `kvpilot` subprocess runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import httpx

from tests.fakes.standin_vllm_module import install

KVPILOT = [sys.executable, "-m", "kvpilot.agent"]
STOP_S = 20.0  # for an agent a test leaves running: its drain of the stand-ins, and more
REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "rig" / "models" / "tiny-llama"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data, indent=2))  # JSON is YAML
    return path


def standin_instance(
    tmp: Path, name: str, port: int, *, plan: str = "serve", metrics: Path | None = None
) -> dict[str, Any]:
    """A local-runtime instance that runs the stand-in vLLM module (see its docstring)."""
    root = install(tmp / "standin")
    env = {
        "PYTHONPATH": str(root),
        "STANDIN_PLAN": plan,
        "STANDIN_STARTS": str(tmp / f"{name}.starts"),
        "STANDIN_TAG": str(tmp),
    }
    if metrics is not None:
        env["STANDIN_METRICS"] = str(metrics)
    # --download-dir puts the test's folder in the command line: processes_with(tmp) finds it.
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(TINY_MODEL),
        "--served-model-name",
        f"standin-{tmp.name}",
        "--download-dir",
        str(tmp / "downloads"),
        "--port",
        str(port),
    ]
    return {"name": name, "argv": argv, "env": env}


def base_config(tmp: Path, instances: Sequence[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A configuration on a free port with the local runtime and quick rules."""
    return {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "interval_s": 0.5,
        "state_dir": str(tmp / "state"),
        "runtime": {
            "kind": "local",
            "ready_timeout_s": 30,
            "drain_timeout_s": 3,
            "instances": list(instances),
        },
        "notifiers": [],
        **extra,
    }


def processes_with(tag: str) -> list[int]:
    """Live processes whose command line mentions `tag` (the stand-ins of one test)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tag in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(poll_s)


class Agent:
    """`kvpilot ARGS` in its own session; stderr and stdout collected line by line."""

    def __init__(self, *args: str) -> None:
        self.args = list(args)
        self.process: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []

    def __enter__(self) -> Self:
        self.process = subprocess.Popen(
            [*KVPILOT, *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        for stream in (self.process.stdout, self.process.stderr):
            reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
            reader.start()
            self._readers.append(reader)
        return self

    def __exit__(self, *exc: object) -> None:
        """Still running: SIGTERM (it stops the servers it started), then SIGKILL."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def output(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def messages(self) -> list[str]:
        """Each line's log message (JSON lines), or the line itself."""
        out = []
        for line in self.output():
            try:
                entry = json.loads(line)
                out.append(str(entry.get("message", line)) if isinstance(entry, dict) else line)
            except ValueError:
                out.append(line)
        return out

    def wait_message(self, text: str, timeout_s: float = 20.0) -> str:
        def found() -> str | None:
            self.check_alive(f"waiting for {text!r}")
            return next((m for m in self.messages() if text in m), None)

        return str(wait_until(found, timeout_s, f"a log line with {text!r}"))

    def check_alive(self, doing: str) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            tail = "\n".join(self.output()[-30:])
            raise AssertionError(f"kvpilot exited ({self.process.returncode}) {doing}:\n{tail}")

    def wait_healthy(self, port: int, timeout_s: float = 20.0) -> None:
        def healthy() -> bool:
            self.check_alive("before /healthz answered 200")
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout_s, "/healthz answered 200", poll_s=0.2)

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        """The exit code; fails (and kills the agent) when it does not exit in time."""
        assert self.process is not None
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            tail = "\n".join(self.output()[-30:])
            raise AssertionError(f"kvpilot did not exit within {timeout_s:g} s:\n{tail}") from None
        for reader in self._readers:
            reader.join(timeout=5)
        return code
