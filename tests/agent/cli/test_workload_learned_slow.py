"""`kvpilot tune` on the CPU rig learns the workload from a server that has been serving:
the real vLLM (the suite's shared roomy server: at most one start) serves more than the
floor (`tuning.learn.min_requests`, set to 80 here) while `kvpilot tune --dry-run
--observe-s` watches its /metrics, and the command says it replays the learned workload,
from how many requests."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kvpilot.agent.cli.main import app
from kvpilot.rig.server import VllmServer, free_port
from kvpilot.tuner.load.generator import LengthDist, LoadReport, Workload, run_load
from tests.agent.sidecar_harness import agent_config, server_spec

pytestmark = pytest.mark.slow

FLOOR = 80  # tuning.learn.min_requests, lowered from 200 to keep the test short
PLANNED = 20_000  # more than the observation can serve: the load runs until it ends


def _load(url: str, n: int, seed: int, until: threading.Event | None = None) -> LoadReport:
    """A closed loop of 16 at a time; with `until`, it keeps sending until that is set, so
    that every scrape of the observation sees requests running (a load that ends after a
    few seconds leaves most scrapes idle, and the window then says nothing of their KV)."""
    workload = Workload(
        n, LengthDist.uniform(24, 40), LengthDist.uniform(3, 5), concurrency=16, seed=seed
    )

    async def send() -> LoadReport:
        stop = asyncio.Event()

        async def stop_when_told(told: threading.Event) -> None:
            await asyncio.to_thread(told.wait)
            stop.set()

        watch = None if until is None else asyncio.create_task(stop_when_told(until))
        report = await run_load(url, workload, model="tiny-llama", stop=stop)
        if watch is not None:
            await watch
        return report

    return asyncio.run(send())


def test_tune_learns_the_workload_from_a_serving_server(
    vllm_server: VllmServer, tmp_path: Path
) -> None:
    # How fast this machine serves such requests now, so the observation serves the floor
    # about three times over.
    started = time.monotonic()
    warm = _load(vllm_server.url, 24, seed=1)
    assert not warm.failed
    per_request_s = (time.monotonic() - started) / 24
    observe_s = max(15, round(3 * FLOOR * per_request_s) + 5)
    config = agent_config(
        tmp_path,
        spec=server_spec(port=vllm_server.spec.port),
        rules={},
        notifiers=[],
        remediation={},
        listen_port=free_port(),
    )
    data = yaml.safe_load(config.read_text())
    data["tuning"] = {"learn": {"min_requests": FLOOR}}
    config.write_text(yaml.safe_dump(data))
    served: list[LoadReport] = []
    tuned = threading.Event()
    load = threading.Thread(
        target=lambda: served.append(_load(vllm_server.url, PLANNED, seed=2, until=tuned))
    )
    result: list[Any] = []

    def tune() -> None:
        args = ["tune", "-c", str(config), "--dry-run", "--observe-s", str(observe_s)]
        try:
            result.append(CliRunner().invoke(app, args, env={"COLUMNS": "250"}))
        finally:
            tuned.set()

    watcher = threading.Thread(target=tune)
    watcher.start()
    load.start()
    watcher.join(timeout=observe_s + 120)
    tuned.set()  # also when the command hung: the load must not outlive the test
    load.join(timeout=60)
    assert served and not served[0].failed
    sent = len(served[0].results)
    assert sent < PLANNED, "the load ran out before the observation ended"
    assert result, "kvpilot tune did not finish"
    output = result[0].output
    assert result[0].exit_code == 0, output
    found = re.search(r"workload: learned \(learned from (\d+) requests over \d+ s: (.+)\)", output)
    assert found, output
    assert FLOOR <= int(found.group(1)) <= sent
    assert found.group(2).startswith("prompt 64/64 gen 4/4")  # the (20, 50] and (2, 5] buckets
    # The KV a running request held, from vLLM's usage gauge over its blocks and the
    # requests running: 27-45 tokens a request, in blocks of 32 tokens, one or two.
    held = re.search(r"; ([\d.]+) KV blocks a running request", found.group(2))
    assert held, output
    assert 0.8 <= float(held.group(1)) <= 2.2
