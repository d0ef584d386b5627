"""The OOM guard on the real CPU vLLM, through `kvpilot run`, in one agent and three starts:

1. a KV budget four times the machine's memory (read from /proc/meminfo) fails the first
   start with vLLM's own "less than requested memory for kv"; the guard steps it down (held
   to the configured ceiling), the server starts and answers a completion;
2. mid-run, the test SIGKILLs the serving vLLM as the stand-in for the OOM killer (a real
   OOM kill is not safe on a shared machine). The cgroup count cannot rise for a test's
   SIGKILL, so the guard reads a memory.events file the configuration names, whose
   `oom_kill` the test raises just before the kill: the evidence the kernel would write.
   The guard steps the budget down again, the server restarts and serves, the new flags are
   recorded as promoted, and `KvpilotServerOOM` reaches a real HTTP receiver.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpilot.agent.state import open_exclusive
from kvpilot.agent.tuning.promoted import PROMOTED_FACT
from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.rig.server import free_port
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
KV = "--kv-cache-memory-bytes"
CEILING = 64 << 20


def _mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def _oom(receiver: Receiver, evidence: str, status: str = "firing") -> list[dict[str, Any]]:
    return [
        alert
        for request in receiver.accepted()
        for alert in request.json().get("alerts", [])
        if alert["labels"].get("alertname") == "KvpilotServerOOM"
        and alert["status"] == status
        and alert["annotations"].get("evidence") == evidence
    ]


def _running_kv(agent: AgentProcess) -> int | None:
    pid = agent.main_pid()
    if pid is None:
        return None
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    value = flag_value(argv, KV)
    return None if value is None else int(value)


def _completes(url: str, model: str) -> bool:
    body = {"model": model, "prompt": [1, 5, 9, 12], "max_tokens": 4, "ignore_eos": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    return answer.status_code == 200 and len(answer.json()["choices"]) == 1


def test_the_oom_guard_steps_the_kv_budget_down_at_start_and_after_an_oom_kill(
    tmp_path: Path,
) -> None:
    receiver = Receiver().start()
    marker = f"oom-{free_port()}"
    too_big = 4 * _mem_total_bytes()
    spec = server_spec(kv_cache_memory_bytes=too_big, served_model_name=marker)
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    port = free_port()
    config = agent_config(
        tmp_path,
        spec=spec,
        listen_port=port,
        rules={"server_down": {"for_s": 1}},
        notifiers=[{"kind": "webhook", "url": f"{receiver.url}/hook"}],
        remediation={
            "cooldown_s": 0,
            "verify_timeout_s": 300,
            "oom": {"max_kv_cache_memory_bytes": CEILING, "memory_events_path": str(events)},
        },
    )
    agent = AgentProcess(config, port, tmp_path / "agent.log").start()
    left: list[int] = []
    try:
        # 1. The first start fails of memory; the step starts it within the ceiling.
        wait_for("the stepped server ready", lambda: agent.started("vllm") or None, 400)
        assert _running_kv(agent) == CEILING
        assert _completes(spec.url, marker)
        first = wait_for("ServerOOM (start-up)", lambda: _oom(receiver, "log"), 60)
        assert first[0]["labels"]["instance"] == "vllm"
        assert first[0]["annotations"]["direction"] == "too_big"
        assert f"{KV} {CEILING}" in first[0]["annotations"]["suggested_flags"]
        log = (tmp_path / "logs" / "vllm.log").read_text(errors="replace")
        assert "is less than requested memory for kv" in log

        # 2. Mid-run: the OOM killer's evidence, then its SIGKILL (the test's stand-in).
        main_pid = agent.main_pid()
        assert main_pid is not None
        events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
        os.kill(main_pid, signal.SIGKILL)
        stepped = CEILING * 3 // 4  # the configured 25 % step
        wait_for(
            "the server back with the stepped budget",
            lambda: agent.main_pid() not in (None, main_pid) and _running_kv(agent) == stepped,
            400,
        )
        wait_for("a completion after the restart", lambda: _completes(spec.url, marker), 120)
        killed = wait_for("ServerOOM (OOM killer)", lambda: _oom(receiver, "oom_killer"), 60)
        assert f"{KV} {stepped}" in killed[0]["annotations"]["suggested_flags"]
        # It resolves once the stepped restart is verified, not while the server starts.
        wait_for("ServerOOM resolved", lambda: _oom(receiver, "oom_killer", "resolved"), 120)
    finally:
        agent.stop()
        left = server_processes(marker)  # the killed server's engine included
        kill_servers_of(marker)
        receiver.stop()
    assert left == [], f"processes of the stopped server left running: {left}"
    # The promotion holds for the next start: recorded with its reason.
    with open_exclusive(tmp_path / "state") as store:
        promoted = store.get_fact(PROMOTED_FACT)
    assert promoted is not None and flag_value(promoted["argv"], KV) == str(stepped)
    assert "OOM killer" in promoted["reason"]
