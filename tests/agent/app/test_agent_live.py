"""The agent against a real CPU vLLM with the kvpool plugin: `collect --once`, `run`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvpilot.rig.server import TINY_MODEL_DIR, VllmServer, free_port
from kvpilot.tuner.load.generator import LengthDist, Workload, run_load

pytestmark = pytest.mark.slow

KVPILOT = [sys.executable, "-m", "kvpilot.agent"]


def _kvpool_url(server: VllmServer) -> str:
    return f"http://127.0.0.1:{server.spec.kvpool_port}"


def _collect(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVPILOT, "collect", "--once", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )


def _load(server: VllmServer, n: int = 16) -> None:
    workload = Workload(
        num_requests=n,
        concurrency=8,
        prompt_len=LengthDist.uniform(16, 200),
        output_len=LengthDist.fixed(32),
        seed=3,
    )
    report = asyncio.run(run_load(server.url, workload))
    assert not report.failed, report.failed[0].error


def test_collect_once_prints_every_source(vllm_server: VllmServer) -> None:
    _load(vllm_server)
    result = _collect(
        "--vllm-url",
        vllm_server.url,
        "--kvpool-url",
        _kvpool_url(vllm_server),
        "--model-config",
        str(TINY_MODEL_DIR / "config.json"),
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # No GPU here: NVML says so with its reason, and everything else carries on.
    assert "nvml: unavailable (" in out and "NVML" in out
    for heading in (
        "KV cache and scheduler",
        "blocks",
        "free",
        "waiting",
        "preempt vllm",
        "frag (kv_blocks)",
        "ttft",
        "inter_token",
        "e2e",
        "queue",
    ):
        assert heading in out, heading
    assert "kvpool:" not in out  # the plugin answered
    # The planner's prediction against the live server (an explicit KV budget: exact).
    assert "planner predicted 2048 blocks, server reports 2048 (diff +0" in out


def test_collect_once_json_has_blocks_quantiles_and_fragmentation(vllm_server: VllmServer) -> None:
    _load(vllm_server)
    result = _collect(
        "--json", "--vllm-url", vllm_server.url, "--kvpool-url", _kvpool_url(vllm_server)
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["nvml"]["status"] == "error" and data["nvml"]["kind"] == "unavailable"
    engine = data["vllm"]["engines"][0]
    assert engine["blocks_total"] == 2047  # 64 MiB / 32 KiB a block, less the null block
    assert 0 <= engine["blocks_free"] <= engine["blocks_total"]
    assert engine["preemptions_total"] is not None
    assert data["vllm"]["vllm_version"] == "0.32.0"
    pool = data["kvpool"]["engines"][0]
    assert pool["blocks_total"] == engine["blocks_total"]
    # Idle after the load: everything free, one run, nothing fragmented.
    assert pool["blocks_free"] == pool["blocks_total"]
    assert pool["fragmentation"]["ratio"] == 0.0
    figures = {(m, q): v for m, q, v in data["figures"][0]["latency_quantiles_s"]}
    assert figures[("ttft", 0.5)] is not None and figures[("ttft", 0.5)] > 0
    assert figures[("e2e", 0.99)] >= figures[("e2e", 0.5)]
    assert data["figures"][0]["span_s"] is None  # one scrape: since start-up


def test_collect_with_span_computes_rates_between_two_scrapes(vllm_server: VllmServer) -> None:
    async def load_while_collecting() -> subprocess.CompletedProcess[str]:
        # Load runs in batches until both scrapes are done: the collect process takes a
        # moment to start, and one fixed batch can finish before its first scrape.
        workload = Workload(
            num_requests=8,
            concurrency=8,
            prompt_len=LengthDist.fixed(64),
            output_len=LengthDist.fixed(64),
        )
        collected = asyncio.Event()

        async def keep_busy() -> None:
            while not collected.is_set():
                report = await run_load(vllm_server.url, workload)
                assert not report.failed, report.failed[0].error

        load = asyncio.create_task(keep_busy())
        try:
            return await asyncio.to_thread(
                _collect, "--json", "--span", "3", "--vllm-url", vllm_server.url
            )
        finally:
            collected.set()
            await load

    result = asyncio.run(load_while_collecting())
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)["figures"][0]
    assert 3.0 <= figures["span_s"] < 5.0  # the time between the two scrapes
    assert figures["generation_tokens_per_s"] > 0
    assert figures["iterations_per_s"] > 0


def test_collect_reports_an_unreachable_server_clearly() -> None:
    # A port bound and never listened on refuses connections, and no other test's server
    # can take it meanwhile (a merely free port can be taken by the next server that starts).
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        result = _collect("--vllm-url", f"http://127.0.0.1:{held.getsockname()[1]}")
    assert result.returncode == 1
    assert "vllm: refused" in result.stdout


def test_run_serves_metrics_and_healthz_and_stops_on_sigterm(vllm_server: VllmServer) -> None:
    port = free_port()
    agent = subprocess.Popen(
        [
            *KVPILOT,
            "run",
            "--vllm-url",
            vllm_server.url,
            "--kvpool-url",
            _kvpool_url(vllm_server),
            "--listen",
            f"127.0.0.1:{port}",
            "--interval",
            "0.5",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                if health.status_code == 200:
                    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
                    if "kvpilot_kvpool_blocks" in text:
                        break
            except httpx.HTTPError:
                pass
            assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
            time.sleep(0.2)
        server = 'role="stable",server="vllm"'
        assert f'kvpilot_collector_up{{{server},source="vllm"}} 1.0' in text
        assert f'kvpilot_collector_up{{{server},source="nvml"}} 0.0' in text
        assert (
            f'kvpilot_collector_errors_total{{reason="unavailable",{server},source="nvml"}}' in text
        )
        assert "kvpilot_kv_usage_ratio{" in text
        assert 'kvpilot_fragmentation_ratio{device="",engine="0"' in text
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
        logs = [
            json.loads(line) for line in (agent.stderr.read() if agent.stderr else "").splitlines()
        ]
        assert any(entry["message"] == "stopped" for entry in logs)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
