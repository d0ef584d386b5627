"""Memory truth and liveness on one real CPU vLLM, started once by one real agent:

* token occupancy for a known workload (blocks of 32, 33-token prompts, prefix caching off)
  read at the plugin's step boundary matches a hand count;
* the engine core stopped with SIGSTOP while the API server still answers /health 200 is
  detected as stalled within its window, restarted (`engine_stall.action: restart`) and
  verified serving.

The tests run in this order on the shared server: the second one replaces its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpilot.rig.server import ServerSpec, free_port
from kvpilot.tuner.load.generator import LengthDist, Workload, run_load
from tests.agent.sidecar_harness import (
    AgentProcess,
    agent_config,
    kill_servers_of,
    server_processes,
    server_spec,
    wait_for,
)

pytestmark = pytest.mark.slow

PROMPT_TOKENS, BLOCK = 33, 32
STALL_S = 8.0
OCCUPANCY = re.compile(r'^kvpool_token_occupancy_ratio\{[^}]*kv_group="0"[^}]*\} (\S+)$', re.M)
IN_USE = re.compile(r'^kvpool_group_blocks_in_use\{[^}]*kv_group="0"[^}]*\} (\S+)$', re.M)
AGENT_OCCUPANCY = re.compile(r"^kvpilot_token_occupancy_ratio\{[^}]*\} (\S+)$", re.M)
TOKENS = re.compile(r'^kvpool_group_tokens_in_use\{[^}]*kv_group="0"[^}]*\} (\S+)$', re.M)


class Served:
    """The module's one agent and the server it runs."""

    def __init__(self, agent: AgentProcess, spec: ServerSpec, marker: str) -> None:
        self.agent, self.spec, self.marker = agent, spec, marker


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("liveness")
    marker = f"live-{free_port()}"
    spec = server_spec(
        served_model_name=marker,
        block_size=BLOCK,
        extra_args=("--no-enable-prefix-caching",),
    )
    port = free_port()
    config = agent_config(
        tmp,
        spec=spec,
        listen_port=port,
        rules={
            "engine_stall": {"stall_s": STALL_S, "for_s": 0, "action": "restart"},
            "preemption_spike": {"action": "alert"},
            "kv_saturation": {"enabled": False},
            "fragmentation": {"kv_blocks": {"enabled": False}},
        },
        notifiers=[],
        # The stopped engine answers nothing: the drain gives up quickly.
        remediation={"cooldown_s": 0, "drain_timeout_s": 3, "verify_timeout_s": 300},
    )
    agent = AgentProcess(config, port, tmp / "agent.log").start()
    try:
        wait_for(
            "vLLM and the plugin up",
            lambda: agent.collector_up("vllm") and agent.collector_up("kvpool"),
            360,
        )
        yield Served(agent, spec, marker)
    finally:
        for pid in server_processes(marker):  # whatever a failed test left stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        agent.stop()
        kill_servers_of(marker)


def _load_in_background(
    served: Served, *, output_tokens: int, stop: threading.Event
) -> threading.Thread:
    """Closed-loop load of 33-token prompts until `stop` is set."""

    def run() -> None:
        seed = 0
        while not stop.is_set():
            workload = Workload(
                num_requests=16,
                concurrency=8,
                prompt_len=LengthDist.fixed(PROMPT_TOKENS),
                output_len=LengthDist.fixed(output_tokens),
                seed=seed,
                request_timeout_s=60,
            )
            with contextlib.suppress(Exception):  # a request cut by the restart is expected
                asyncio.run(run_load(served.spec.url, workload, model=served.marker))
            seed += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _plugin_reading(served: Served) -> tuple[float, int, int] | None:
    """(occupancy, blocks in use, tokens) of the plugin's latest step-boundary snapshot, once
    some request holds blocks."""
    text = httpx.get(f"http://127.0.0.1:{served.spec.kvpool_port}/metrics", timeout=5).text
    ratio, in_use, tokens = OCCUPANCY.search(text), IN_USE.search(text), TOKENS.search(text)
    if ratio is None or in_use is None or tokens is None:
        return None  # no block in use at that boundary: read again
    return float(ratio.group(1)), int(float(in_use.group(1))), int(float(tokens.group(1)))


def test_token_occupancy_of_a_known_workload_matches_a_hand_count(served: Served) -> None:
    # Two output tokens: at the boundary after its prefill a request has its one output token
    # and still holds its blocks (with one, it finishes and frees them in that very step).
    # Every request holding blocks at a boundary then holds 33 computed tokens in 2 blocks.
    hand_count = PROMPT_TOKENS / (2 * BLOCK)  # 33 / 64 = 0.5156
    stop = threading.Event()
    _load_in_background(served, output_tokens=2, stop=stop)
    try:
        ratio, in_use, tokens = wait_for("blocks in use", lambda: _plugin_reading(served), 60, 0.3)
        # The agent exports the figure under its own name (absent at an idle boundary).
        agent_ratio = wait_for("the agent's figure", lambda: _agent_reading(served), 60, 0.5)
    finally:
        stop.set()
    assert abs(ratio - hand_count) <= 0.01, (ratio, in_use, tokens)
    assert in_use % 2 == 0 and tokens == PROMPT_TOKENS * in_use // 2, (in_use, tokens)
    assert abs(agent_ratio - hand_count) <= 0.01, agent_ratio


def _agent_reading(served: Served) -> float | None:
    found = AGENT_OCCUPANCY.search(served.agent.metrics())
    return float(found.group(1)) if found else None


def _engine_core(served: Served) -> int:
    """The server's child titled VLLM::EngineCore."""
    for pid in server_processes(served.marker):
        with contextlib.suppress(OSError):
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"EngineCore" in title:
                return pid
    raise AssertionError(f"no EngineCore among {server_processes(served.marker)}")


def _restarts(agent: AgentProcess) -> list[dict[str, Any]]:
    return [
        r
        for r in agent.status()["last_actions"]
        if r["action"] == "restart" and r["state"] in ("succeeded", "failed")
    ]


def _serves(served: Served) -> bool:
    body = {"model": served.marker, "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}
    got = httpx.post(f"{served.spec.url}/v1/completions", json=body, timeout=30)
    return got.status_code == 200 and len(got.json()["choices"]) == 1


def test_a_frozen_engine_behind_a_healthy_api_is_restarted_and_serves(served: Served) -> None:
    agent = served.agent
    first_pid = agent.main_pid()
    engine = _engine_core(served)
    stop = threading.Event()
    _load_in_background(served, output_tokens=64, stop=stop)
    try:
        wait_for("requests running", lambda: "vllm:num_requests_running" in _running(served), 60)
        os.kill(engine, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # The API server still says healthy: only progress tells.
        assert httpx.get(f"{served.spec.url}/health", timeout=5).status_code == 200
        fired = wait_for(
            "VllmEngineStalled",
            lambda: [
                a
                for a in agent.status()["alerts"]
                if dict(a["labels"])["alertname"] == "VllmEngineStalled"
            ],
            STALL_S + 30,
            0.5,
        )
        detected_s = time.monotonic() - stopped_at
        # Its window, plus the scrape and tick that see it (the agent's interval is 1 s).
        assert detected_s <= STALL_S + 10, (detected_s, fired)
        stop.set()
        restarted = wait_for("the restart", lambda: _restarts(agent), 400)
        assert restarted[0]["state"] == "succeeded", restarted
        assert agent.main_pid() not in (None, first_pid)
        assert not Path(f"/proc/{engine}").exists() or engine not in server_processes(
            served.marker
        ), "the stopped engine outlived its restart"
        wait_for("the restarted server serving", lambda: _serves(served), 120)
    finally:
        stop.set()
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGCONT)


def _running(served: Served) -> str:
    """vLLM's running gauge lines with a value above 0 (empty while idle)."""
    text = httpx.get(f"{served.spec.url}/metrics", timeout=5).text
    return "\n".join(
        line
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running{") and float(line.split()[-1]) > 0
    )
