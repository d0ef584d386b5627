"""The embedded default: a local CPU vLLM under a moderate load, watched by the agent."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from dataclasses import dataclass

from kvpilot.agent.app.compose import run_sidecar
from kvpilot.agent.cli.live_view import LiveView
from kvpilot.agent.config import validate_config
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.agent.tick.ticker import TickState
from kvpilot.rig.server import ServerSpec, VllmServer, free_port
from kvpilot.tuner.loadgen import LengthDist, Workload, run_load

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DemoSettings:
    duration_s: float | None = None
    listen_port: int = 9400
    # 128 blocks of 32 tokens: eight long requests at once do not fit, so the view shows
    # real preemptions and a scattered free list, not only idle numbers.
    kv_cache_memory_bytes: int = 4 * 1024 * 1024
    concurrency: int = 8
    live_view: bool = True


def demo_workload(seed: int, concurrency: int) -> Workload:
    return Workload(
        num_requests=4 * concurrency,
        concurrency=concurrency,
        prompt_len=LengthDist.uniform(32, 400),
        output_len=LengthDist.uniform(32, 256),
        seed=seed,
    )


async def _keep_loading(url: str, settings: DemoSettings, stop: asyncio.Event) -> None:
    seed = 0
    while not stop.is_set():
        report = await run_load(url, demo_workload(seed, settings.concurrency), stop=stop)
        if report.failed and not stop.is_set():
            log.warning(
                "load: %d of %d requests failed: %s",
                len(report.failed),
                len(report.results),
                report.failed[0].error,
            )
        seed += 1


async def run_demo(settings: DemoSettings) -> None:
    spec = ServerSpec(
        port=free_port(),
        kvpool_port=free_port(),
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
    )
    server = VllmServer(spec)
    log.info("starting a CPU vLLM on %s (log: %s); about a minute", spec.url, server.log_path)
    server.start()
    try:
        await asyncio.to_thread(server.wait_healthy)
        log.info(
            "vLLM healthy; loading it and serving kvpilot metrics on :%d", settings.listen_port
        )
        await _watch(server, spec, settings)
    finally:
        await asyncio.to_thread(server.stop)


async def _watch(server: VllmServer, spec: ServerSpec, settings: DemoSettings) -> None:
    """The sidecar loop of `kvpilot run`, watching the demo's server by URL."""
    stop = asyncio.Event()
    with tempfile.TemporaryDirectory(prefix="kvpilot-demo-") as state_dir:
        config = validate_config(
            {
                "listen": {"host": "127.0.0.1", "port": settings.listen_port},
                "state_dir": state_dir,
                "runtime": {
                    "kind": "attach",
                    "servers": [
                        {
                            "name": "demo",
                            "url": spec.url,
                            "kvpool_url": f"http://127.0.0.1:{spec.kvpool_port}",
                            "pids": [server.pid],
                        }
                    ],
                },
            }
        )
        view = LiveView(title=f"kvpilot demo: {spec.url}")
        load = asyncio.create_task(_keep_loading(spec.url, settings, stop), name="demo-load")
        timer = (
            asyncio.get_running_loop().call_later(settings.duration_s, stop.set)
            if settings.duration_s
            else None
        )
        with view if settings.live_view else contextlib.nullcontext():
            try:
                await run_sidecar(
                    config,
                    stop=stop,
                    on_tick=(lambda s: view.show(_first_server_state(s)))
                    if settings.live_view
                    else None,
                )
            finally:
                stop.set()
                if timer is not None:
                    timer.cancel()
                load.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await load


def _first_server_state(sidecar: Sidecar) -> TickState | None:
    servers = sidecar.servers()
    return servers[0].state if servers else None
