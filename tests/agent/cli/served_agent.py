"""A real agent app (the real `api_routes` over a real Sidecar: SQLite store, attach runtime,
remediator) served by uvicorn on a loopback port from a thread of its own, for the commands
that reach an agent over HTTP. No vLLM: the attach runtime names a port nobody listens on.

Everything lives on the server's thread (SQLite refuses other threads); `on_loop` runs a
setup step there."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Self, TypeVar

import uvicorn
from pydantic import SecretStr

from kvpilot.agent.app.api import api_routes
from kvpilot.agent.app.exposition import build_registry
from kvpilot.agent.app.http import build_app
from kvpilot.agent.app.parts import build_runtime, control_ports
from kvpilot.agent.config import AgentConfig
from kvpilot.agent.state import StateStore
from kvpilot.agent.tick.sidecar import Sidecar
from tests.agent.quiet_sidecar import quiet_sidecar

TOKEN = "operator-cli-token-7f3c"
START_DEADLINE_S = 20.0
T = TypeVar("T")


class ServedAgent:
    def __init__(self, state_dir: Path) -> None:
        self._state_dir = state_dir
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._server: uvicorn.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sidecar: Sidecar | None = None
        self._thread = threading.Thread(target=self._serve, name="served-agent", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(START_DEADLINE_S):
            raise AssertionError(f"the agent did not start within {START_DEADLINE_S} s")
        if self._failure is not None:
            raise AssertionError(f"the agent did not start: {self._failure!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=START_DEADLINE_S)
        self._sock.close()

    def on_loop(self, step: Callable[[Sidecar], T]) -> T:
        """`step(sidecar)` run on the server's thread, its result returned here."""
        assert self._loop is not None and self._sidecar is not None
        sidecar = self._sidecar

        async def run() -> T:
            return step(sidecar)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(START_DEADLINE_S)

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to the test thread, which raises it
            self._failure = exc
            self._ready.set()

    async def _main(self) -> None:
        config = AgentConfig.model_validate(
            {
                "state_dir": str(self._state_dir),
                "runtime": {
                    "kind": "attach",
                    "servers": [{"name": "vllm", "url": "http://127.0.0.1:9"}],
                },
            }
        )
        config.state_dir.mkdir(parents=True, exist_ok=True)
        with StateStore.open(config.state_dir) as store:
            runtime = build_runtime(config)
            sidecar = quiet_sidecar(config, store, runtime)
            app = build_app(
                sidecar,
                build_registry(sidecar.watched.servers, lambda out: None),
                clock=sidecar.clock,
                stale_after_s=10.0,
                extra_routes=api_routes(control_ports(config, sidecar), SecretStr(TOKEN)),
            )
            server = uvicorn.Server(
                uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
            )
            self._server, self._loop, self._sidecar = server, asyncio.get_running_loop(), sidecar
            serving = asyncio.create_task(server.serve(sockets=[self._sock]))
            # uvicorn offers no started event to await: its flag, polled.
            while not server.started and not serving.done():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            self._ready.set()
            try:
                await serving
            finally:
                await sidecar.aclose()
