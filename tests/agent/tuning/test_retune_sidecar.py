"""Re-tuning through the real sidecar loop: a server upgraded under a tuned configuration
raises KvpilotTuningRecommended at a real webhook receiver, once, and it resolves when the
server is back on the version it was tuned on.

The agent runs in this process through its real composition (`run_sidecar`: the store, the
tick, the HTTP server, the outbox) against a recorded vLLM `/metrics` on loopback whose
`/version` the test changes; an upgrade restarts a server, so the stand-in fails one scrape
in between (the collector reads `/version` again after a failed scrape). No vLLM starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, TypeVar

from kvpilot.agent.app.compose import run_sidecar
from kvpilot.agent.config import validate_config
from kvpilot.agent.remediation.events import TUNING_RECOMMENDED_ALERT
from kvpilot.agent.state import StateStore
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.agent.tuning.ground import Ground, GroundStore
from kvpilot.rig.server import free_port
from tests.agent.notify.notify_receiver import Receiver
from tests.agent.state.loopback import CALM, agent_config
from tests.http_helpers import ServedInThread

T = TypeVar("T")


class UpgradableVllm(ServedInThread):
    """A recorded vLLM `/metrics`; `/version` says `version`; while `down`, every request
    is answered 503 (the server restarting), counted in `refused`."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.down = False
        self.refused = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if server.down:
                    server.refused += 1
                    body, status = b"", 503
                else:
                    body = {
                        "/metrics": CALM,
                        "/health": b"",
                        "/version": json.dumps({"version": server.version}).encode(),
                    }.get(self.path, b"")
                    status = 200 if self.path in ("/metrics", "/health", "/version") else 404
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                """Quiet."""

        super().__init__(Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def notified(receiver: Receiver, status: str) -> list[dict[str, Any]]:
    return [
        alert
        for request in receiver.accepted()
        for alert in request.json().get("alerts", [])
        if alert["labels"].get("alertname") == TUNING_RECOMMENDED_ALERT
        and alert["status"] == status
    ]


async def restart_as(vllm: UpgradableVllm, sidecar: Sidecar, version: str) -> None:
    """The server goes down for a scrape and comes back as `version`."""
    refused = vllm.refused
    vllm.down = True
    await wait_for("a refused scrape", lambda: vllm.refused > refused)
    vllm.version = version
    vllm.down = False
    await wait_for(
        f"a scrape of {version}",
        lambda: (
            (s := sidecar.watched.latest_vllm("vllm")) is not None and s.vllm_version == version
        ),
    )


def test_an_upgraded_server_raises_tuning_recommended_once_and_it_resolves(
    tmp_path: Path,
) -> None:
    state_dir = tmp_path / "state"
    with StateStore.open(state_dir) as store:  # tuned on 0.32.0 by an earlier run
        GroundStore(store.db).save("vllm", Ground("0.32.0", None, None), time.time() - 60)
    receiver = Receiver().start()

    async def scenario(vllm: UpgradableVllm) -> None:
        port = free_port()
        data = agent_config(
            state_dir,
            vllm_url=vllm.url,
            receiver_url=receiver.url,
            listen_port=port,
            interval_s=0.2,
        )
        data["tuning"] = {"retune": {"check_every_s": 0.2}}
        config = validate_config(data, {}, warn=False)
        stop = asyncio.Event()
        ticked: list[Sidecar] = []
        agent = asyncio.create_task(run_sidecar(config, stop=stop, on_tick=ticked.append))
        try:
            sidecar = await wait_for("the first tick", lambda: ticked[0] if ticked else None)
            await wait_for(
                "the first check audited",
                lambda: [r for r in sidecar.store.audit_records() if r.action == "retune"],
            )
            ticks = sidecar.ticks_total
            await wait_for("five more ticks", lambda: sidecar.ticks_total >= ticks + 5)
            assert notified(receiver, "firing") == []  # the ground holds

            await restart_as(vllm, sidecar, "0.33.0")
            firing = await wait_for("the alert", lambda: notified(receiver, "firing"))
            assert "vLLM 0.32.0 -> 0.33.0" in firing[0]["annotations"]["summary"]
            assert firing[0]["labels"]["rule"] == "retune"
            ticks = sidecar.ticks_total
            await wait_for("ten more ticks", lambda: sidecar.ticks_total >= ticks + 10)
            assert len(notified(receiver, "firing")) == 1  # once per change

            await restart_as(vllm, sidecar, "0.32.0")  # rolled back: the ground is back
            await wait_for("the alert resolved", lambda: notified(receiver, "resolved"))
            decisions = [
                r.decision
                for r in reversed(sidecar.store.audit_records(limit=1000))
                if r.action == "retune"
            ]
            assert decisions[-2:] == ["recommended", "settled"], decisions
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(agent, timeout=30)

    try:
        with UpgradableVllm("0.32.0") as vllm:
            asyncio.run(scenario(vllm))
    finally:
        receiver.stop()


def test_server_version_reads_version_or_says_none() -> None:
    from kvpilot.agent.tuning.ground import server_version

    with UpgradableVllm("0.10.1") as vllm:
        assert asyncio.run(server_version(vllm.url)) == "0.10.1"
        vllm.down = True
        assert asyncio.run(server_version(vllm.url)) is None
    assert asyncio.run(server_version(f"http://127.0.0.1:{free_port()}")) is None  # nobody
