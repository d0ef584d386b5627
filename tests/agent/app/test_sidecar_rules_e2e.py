"""More of the sidecar end to end, each with its own agent and real CPU vLLM:

* the fragmentation rule on the plugin's real `kv_blocks` figures, with restart configured;
* a permanent fault: a server that cannot start. Restarts fail, the circuit breaker opens
  and pages once, and there is no restart loop.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from kvpilot.rig.server import TINY_MODEL_DIR, free_port
from kvpilot.tuner.load.generator import LengthDist, Workload, run_load
from tests.agent.notify.notify_receiver import Receiver
from tests.agent.sidecar_harness import (
    AgentProcess,
    agent_config,
    kill_servers_of,
    server_processes,
    server_spec,
    wait_for,
)

pytestmark = pytest.mark.slow


def _alerts(agent: AgentProcess, alertname: str, state: str) -> list[dict[str, Any]]:
    return [
        a
        for a in agent.status()["alerts"]
        if dict(a["labels"])["alertname"] == alertname and a["state"] == state
    ]


def _restarts(agent: AgentProcess) -> list[dict[str, Any]]:
    """Restarts attempted (a record skipped by a guard is not an attempt)."""
    return [
        r
        for r in agent.status()["last_actions"]
        if r["action"] == "restart" and r["state"] not in ("skipped", "vetoed")
    ]


def _skipped(agent: AgentProcess) -> list[dict[str, Any]]:
    return [r for r in agent.status()["last_actions"] if r["state"] == "skipped"]


def _notified(receiver: Receiver, alertname: str, status: str) -> list[dict[str, Any]]:
    return [
        alert
        for request in receiver.accepted()
        for alert in request.json().get("alerts", [])
        if alert["labels"].get("alertname") == alertname and alert["status"] == status
    ]


def test_fragmentation_on_real_kv_blocks_restarts_and_resolves(tmp_path: Path) -> None:
    receiver = Receiver().start()
    marker = f"frag-{free_port()}"
    # 256 blocks: a mixed load leaves free blocks scattered between running requests.
    spec = server_spec(kv_cache_memory_bytes=256 * 32 * 1024, served_model_name=marker)
    port = free_port()
    config = agent_config(
        tmp_path,
        spec=spec,
        listen_port=port,
        rules={
            "fragmentation": {
                "kv_blocks": {"threshold_ratio": 0.3, "for_s": 2, "action": "restart"}
            },
            "preemption_spike": {"action": "alert"},
            "kv_saturation": {"enabled": False},
            "engine_stall": {"enabled": False},
        },
        notifiers=[{"kind": "webhook", "url": f"{receiver.url}/hook"}],
        remediation={"cooldown_s": 0, "drain_timeout_s": 10, "verify_timeout_s": 300},
    )
    agent = AgentProcess(config, port, tmp_path / "agent.log").start()
    stop = threading.Event()
    try:
        wait_for(
            "vLLM up", lambda: agent.collector_up("vllm") and agent.collector_up("kvpool"), 360
        )
        first_pid = agent.main_pid()

        def load() -> None:
            seed = 0
            while not stop.is_set():
                workload = Workload(
                    num_requests=24,
                    concurrency=12,
                    prompt_len=LengthDist.uniform(16, 600),
                    output_len=LengthDist.uniform(8, 200),
                    seed=seed,
                    request_timeout_s=240,
                )
                asyncio.run(run_load(spec.url, workload, model=marker))
                seed += 1

        threading.Thread(target=load, daemon=True).start()
        firing = wait_for(
            "VllmKvFragmentationHigh notified",
            lambda: _notified(receiver, "VllmKvFragmentationHigh", "firing"),
            300,
        )
        assert firing[0]["labels"]["source"] == "kv_blocks"
        # The value as notified: the alert itself may already be leaving `firing` (its
        # restart starts as soon as it fires, with no cooldown), so the API is not asked.
        fired = re.search(
            r"fragmentation ([0-9.]+) above 0.300", firing[0]["annotations"]["summary"]
        )
        assert fired and float(fired.group(1)) > 0.3, firing[0]
        stop.set()  # the restart must clear it, and the load would scatter the blocks again
        restarted = wait_for(
            "the restart it configured",
            lambda: [r for r in _restarts(agent) if r["state"] in ("succeeded", "failed")],
            400,
        )
        assert restarted[0]["state"] == "succeeded", restarted
        assert agent.main_pid() not in (None, first_pid)
        wait_for(
            "the resolved notification",
            lambda: _notified(receiver, "VllmKvFragmentationHigh", "resolved"),
            240,
        )
        # Idle after the restart: every block free in one run.
        metrics = agent.metrics()
        assert 'source="kv_blocks"} 0.0' in metrics
    finally:
        stop.set()
        agent.stop()
        kill_servers_of(marker)
        receiver.stop()


def test_a_server_that_cannot_start_opens_the_circuit_and_pages_once(tmp_path: Path) -> None:
    receiver = Receiver().start()
    marker = f"broken-{free_port()}"
    # The server starts once from its own copy of the model folder; then the folder loses
    # its config.json and the server is killed, so every start after that fails. (A server
    # that never became ready ends `kvpilot run` instead: tested in tests/faults.)
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL_DIR, model)
    spec = server_spec(model_dir=model, served_model_name=marker)
    port = free_port()
    config = agent_config(
        tmp_path,
        spec=spec,
        listen_port=port,
        rules={"server_down": {"for_s": 1}},
        notifiers=[{"kind": "webhook", "url": f"{receiver.url}/hook"}],
        remediation={
            "cooldown_s": 0,
            "verify_timeout_s": 240,
            "budget": {"max_restarts": 10, "window_s": 3600},
            # The fault does not go away, so there is one incident and one restart that
            # fails: the breaker opens on that first failure and pages.
            "circuit_breaker": {"failures_to_open": 1, "hold_s": 600},
        },
    )
    agent = AgentProcess(config, port, tmp_path / "agent.log").start()
    left: list[int] = []
    try:
        # Ready as the runtime says it (its probe answered), not only scraped: a server killed
        # between the two would be one that never started, which ends `kvpilot run`.
        wait_for("the server ready", lambda: agent.started("vllm") or None, 300)
        (model / "config.json").unlink()
        main_pid = agent.main_pid()
        assert main_pid is not None
        os.kill(main_pid, signal.SIGKILL)
        wait_for("VllmServerDown firing", lambda: _alerts(agent, "VllmServerDown", "firing"), 300)
        page = wait_for(
            "the circuit-open page",
            lambda: _notified(receiver, "KvpilotRemediationCircuitOpen", "firing"),
            900,
        )
        assert page[0]["labels"]["severity"] == "critical"
        # The page is an alert like any rule's: the API lists it (and silences apply).
        assert _alerts(agent, "KvpilotRemediationCircuitOpen", "firing")
        restarts = _restarts(agent)
        assert len(restarts) == 1 and restarts[0]["state"] == "failed", restarts
        breaker = agent.status()["remediation"]["breakers"]
        assert [b["state"] for b in breaker if b["instance"] == "vllm"] == ["open"]
        # No restart loop: the alert keeps firing, nothing more is attempted or paged.
        ticks = agent.status()["ticks_total"]
        wait_for("fifteen more ticks", lambda: agent.status()["ticks_total"] >= ticks + 15, 60)
        assert len(_restarts(agent)) == 1
        # A later incident (the server counts as running while it tries to start, so the
        # alert can resolve and fire again) is refused by a guard, never restarted.
        assert all(r["reason"].startswith("skipped:") for r in _skipped(agent))
        assert len(_notified(receiver, "KvpilotRemediationCircuitOpen", "firing")) == 1
        assert 'kvpilot_remediation_circuit_open{server="vllm"} 1.0' in agent.metrics()
    finally:
        agent.stop()
        left = server_processes(marker)  # the killed server's engine included
        kill_servers_of(marker)
        receiver.stop()
    assert left == [], f"processes of the stopped server left running: {left}"
