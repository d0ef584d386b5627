"""A hung or misanswering API server (the fake API server's injected faults: no real one runs
here) never freezes the agent: every call has a deadline, the tick reads it off the event
loop, an HTML 200 falls back to the pod's own processes like any failure, and the agent stops
promptly while requests hang."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from kvpilot.agent.app import parts
from kvpilot.agent.app.compose import run_sidecar
from kvpilot.agent.config import validate_config
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes import api
from kvpilot.agent.runtimes.kubernetes.pod import PodRuntime, strict_reads
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.rig.server import free_port
from tests.agent.k8s.conftest import NAMESPACE, base_deployment
from tests.agent.k8s.test_pod_runtime import pod_config
from tests.agent.k8s.test_pod_sidecar import wait_for

DEADLINE_S = (1.0, 1.0)  # a loaded machine still answers the fake in time


@pytest.fixture(autouse=True)
def short_deadline(monkeypatch) -> None:
    monkeypatch.setattr(api, "REQUEST_TIMEOUT_S", DEADLINE_S)


def in_thread(fn, limit_s: float) -> tuple[object, float]:
    """fn() in a thread, its result (or exception) and how long it took; the test fails
    rather than hangs when it takes longer than `limit_s`."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    started = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(limit_s)
    assert out, f"still waiting after {limit_s} s: no deadline"
    return out[0], time.monotonic() - started


def test_a_request_the_api_server_never_answers_fails_within_its_deadline(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    runtime = parts.build_runtime(pod_config(tmp_path, namespace=NAMESPACE, api_url=fake.host))
    assert isinstance(runtime, PodRuntime)
    fake.hang("GET", r"/deployments/vllm$")

    def strict() -> object:
        with strict_reads():
            return runtime.instances()

    failed, took_s = in_thread(strict, limit_s=10)

    assert isinstance(failed, RuntimeFailure) and "did not answer" in str(failed)
    assert took_s < 5  # a few read deadlines (the client retries), never for ever


def test_an_html_page_with_200_falls_back_to_the_pods_processes(fake, tmp_path) -> None:
    fake.add_deployment(base_deployment(8000))
    runtime = parts.build_runtime(pod_config(tmp_path, namespace=NAMESPACE, api_url=fake.host))
    assert isinstance(runtime, PodRuntime)
    fake.answer_html("GET", r"/deployments/vllm$")

    (stable,) = runtime.instances()  # the tick goes on, on the pod's own vLLM

    assert (stable.name, stable.role, stable.argv) == ("llm", "stable", None)
    assert runtime.api_failures_total == 1
    with strict_reads(), pytest.raises(RuntimeFailure, match=r"not one|not JSON"):
        runtime.instances()  # the tuner is told, not given an empty Deployment


def test_the_tick_goes_on_and_the_agent_stops_while_the_api_server_hangs(
    fake, tmp_path, monkeypatch
) -> None:
    fake.add_deployment(base_deployment(8000))
    monkeypatch.setattr(parts, "API_READ_INTERVAL_S", 1.0)
    config = validate_config(
        {
            "listen": {"host": "127.0.0.1", "port": free_port()},
            "interval_s": 0.1,
            "state_dir": str(tmp_path / "state"),
            "runtime": {
                "kind": "pod",
                "port": 8000,
                "kubernetes": {"namespace": NAMESPACE, "deployment": "vllm", "api_url": fake.host},
            },
        },
        {},
        warn=False,
    )

    async def main() -> tuple[int, float]:
        stop = asyncio.Event()
        ticked: list[Sidecar] = []
        agent = asyncio.create_task(run_sidecar(config, stop=stop, on_tick=ticked.append))
        try:
            await wait_for("first tick", lambda: ticked or None, timeout_s=20)
            fake.hang("GET", r".*")  # from here on the API server accepts and never answers
            before = len(ticked)
            await wait_for("ten ticks while it hangs", lambda: len(ticked) >= before + 10 or None)
            return len(ticked) - before, time.monotonic()
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(agent, timeout=20)

    started_s = time.monotonic()
    ticks, stop_asked_s = asyncio.run(main())  # asyncio.run waits for the reading threads too
    stopped_in_s = time.monotonic() - stop_asked_s

    assert ticks >= 10
    assert stopped_in_s < 5, f"stopped {stopped_in_s:.1f} s after being asked"
    assert time.monotonic() - started_s < 30


def test_a_read_on_the_event_loop_waits_briefly_then_not_at_all(
    fake, tmp_path, monkeypatch
) -> None:
    """The status API and the OOM guard read on the loop: a hang may stop it a moment only."""
    fake.add_deployment(base_deployment(8000))
    runtime = parts.build_runtime(pod_config(tmp_path, namespace=NAMESPACE, api_url=fake.host))
    assert isinstance(runtime, PodRuntime)
    monkeypatch.setattr(api, "REQUEST_TIMEOUT_S", (5.0, 10.0))  # as shipped, off the loop
    fake.hang("GET", r"/deployments/vllm$")

    async def on_the_loop() -> tuple[float, float]:
        started = time.monotonic()
        (stable,) = runtime.instances()  # falls back to the pod's processes
        first = time.monotonic() - started
        assert stable.role == "stable"
        started = time.monotonic()
        runtime.instances()  # the API server failed a moment ago: not tried
        runtime.termination_reason("llm")
        return first, time.monotonic() - started

    (first_s, then_s), _ = in_thread(lambda: asyncio.run(on_the_loop()), limit_s=30)

    assert first_s < 4 and then_s < 0.5, (first_s, then_s)
