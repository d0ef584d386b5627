"""A SIGTERM that comes while `kvpilot run` is still composing (a server just adopted, the
HTTP server not yet up) ends in the same clean shutdown as one that comes while it serves,
and a SIGHUP then is answered: never the default action of either, which would kill the
agent and leave what it owns running.

The agent runs in this process through its real composition (`run_sidecar`) against a
recorded vLLM on loopback; the signals are real ones, sent to this process from inside the
composition. Should the agent not own them by then, stand-in handlers of the test take them
(so the test process lives) and the test fails on the agent that never stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.agent.app.compose import run_sidecar
from kvpilot.agent.config import validate_config
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.rig.server import free_port
from tests.agent.state.loopback import LoopbackVllm, agent_config

STOP_S = 20.0


@pytest.fixture
def vllm() -> Iterator[LoopbackVllm]:
    with LoopbackVllm() as server:
        yield server


def test_signals_while_composing_are_the_agents_a_sigterm_stops_it_cleanly(
    tmp_path: Path,
    vllm: LoopbackVllm,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    data = agent_config(
        tmp_path / "state",
        vllm_url=vllm.url,
        receiver_url="http://127.0.0.1:9/unused",
        listen_port=free_port(),
        interval_s=0.2,
    )
    config = validate_config(data, {}, warn=False)
    reconcile = Sidecar.reconcile

    def reconcile_then_signal(self: Sidecar) -> None:
        reconcile(self)  # where a local runtime then adopts what an earlier kvpilot left
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Sidecar, "reconcile", reconcile_then_signal)
    taken_by_the_test: list[int] = []
    before = {
        sig: signal.signal(sig, lambda sig, _frame: taken_by_the_test.append(sig))
        for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    try:
        asyncio.run(asyncio.wait_for(run_sidecar(config), STOP_S))
    except TimeoutError:
        pytest.fail(f"the agent did not stop on a SIGTERM sent while composing ({STOP_S:g} s)")
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert taken_by_the_test == [], "a signal reached the test's handler, not the agent"
    # Answered (said too early, or as a reload by the time the loop reads it), never obeyed.
    assert any(m.startswith("received SIGHUP") for m in caplog.messages), caplog.messages
    assert "received SIGTERM, shutting down" in caplog.messages
    assert "stopped" in caplog.messages  # the shutdown path ran to its end
