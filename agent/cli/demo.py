"""The embedded default: a local CPU vLLM under a moderate load, watched by the agent."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass

import httpx

from kvpilot.agent.app.lifecycle import LoopSettings, run_agent
from kvpilot.agent.cli.live_view import LiveView
from kvpilot.agent.tick.wiring import CollectSettings, build_ticker
from kvpilot.collectors.procfs import live_group_members
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
    stop = asyncio.Event()
    collect = CollectSettings(
        vllm_url=spec.url,
        kvpool_url=f"http://127.0.0.1:{spec.kvpool_port}",
        rate_span_s=15.0,
        quantile_span_s=30.0,
    )
    async with httpx.AsyncClient() as client:
        ticker = build_ticker(
            collect, client, server_pids=lambda: frozenset(live_group_members(server.pid))
        )
        view = LiveView(ticker.state, title=f"kvpilot demo: {spec.url}")
        load = asyncio.create_task(_keep_loading(spec.url, settings, stop))
        timer = (
            asyncio.get_running_loop().call_later(settings.duration_s, stop.set)
            if settings.duration_s
            else None
        )
        loop_settings = dataclasses.replace(LoopSettings(), listen_port=settings.listen_port)
        with view if settings.live_view else contextlib.nullcontext():
            try:
                await run_agent(
                    ticker,
                    loop_settings,
                    stop=stop,
                    on_tick=view.refresh if settings.live_view else None,
                )
            finally:
                stop.set()
                if timer is not None:
                    timer.cancel()
                await load
