"""`kvpilot run` on the pod runtime, as a process, while the API server (the fake, in this
test's process: no real API server runs here) accepts connections and never answers: the
agent keeps ticking and SIGTERM stops it within seconds, not after its reads' deadlines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.faults.agent_process import stop, ticks
from tests.faults.running_agent import free_port, write_config

pytestmark = pytest.mark.slow  # starts the agent as a process (no vLLM)


def scrape(url: str) -> float:
    try:
        return ticks(httpx.get(f"{url}/metrics", timeout=2.0).text)
    except httpx.HTTPError:
        return 0.0


def wait_ticks(process: subprocess.Popen[bytes], url: str, above: float, log: Path) -> float:
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        if (now := scrape(url)) > above:
            return now
        time.sleep(0.2)
    pytest.fail(f"no tick past {above} within 40 s:\n{log.read_text()[-3000:]}")


def test_sigterm_stops_the_agent_promptly_while_the_api_server_hangs(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    port = free_port()
    config = write_config(
        tmp_path / "kvpilot.yaml",
        {
            "listen": {"host": "127.0.0.1", "port": port},
            "interval_s": 0.2,
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "pod",
                "port": 8000,
                "kubernetes": {"namespace": NAMESPACE, "deployment": "vllm", "api_url": fake.host},
            },
            "notifiers": [],
        },
    )
    url, log = f"http://127.0.0.1:{port}", tmp_path / "agent.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvpilot.agent", "run", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        first = wait_ticks(process, url, 0, log)
        fake.hang("GET", r".*")  # from here every read waits for ever
        hung_at = len(fake.requests)
        wait_ticks(process, url, first + 10, log)  # ticks go on, from the pod's processes
        deadline = time.monotonic() + 40
        while len(fake.requests) == hung_at and time.monotonic() < deadline:
            time.sleep(0.1)  # an API read is in flight and hanging
        os.killpg(process.pid, signal.SIGTERM)
        asked = time.monotonic()
        process.wait(timeout=25)
        stopped_in_s = time.monotonic() - asked
    finally:
        stop(process)

    assert len(fake.requests) > hung_at  # it was reading when told to stop
    assert process.returncode == 0, log.read_text()[-3000:]
    assert stopped_in_s < 5, f"{stopped_in_s:.1f} s after SIGTERM"
