"""The servers a tick watches and the latest readings of each: a ticker and an HTTP client per
server, its role and processes, and the host's latest NVML reading.

This is the tick's observe step, and what the rest of the agent reads between ticks: the
memory pre-flight and the OOM guard read the latest NVML snapshot and cache config, the tuner
the latest vLLM scrape, the exposition each server's view. It is built before them, so none
of them needs the loop that fills it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpilot.agent.model import Instance, Labels
from kvpilot.agent.readings.snapshot import NvmlReading, Snapshot, read_nvml
from kvpilot.agent.tasks import GuardedTasks
from kvpilot.agent.tick.calibration import model_config_of
from kvpilot.agent.tick.settings import TickSettings
from kvpilot.agent.tick.ticker import Ticker
from kvpilot.agent.tick.views import ServerView
from kvpilot.agent.tick.wiring import CollectSettings, build_taker, build_ticker
from kvpilot.collectors.dcgm import DcgmSnapshot, DcgmSource
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import NvmlSnapshot
from kvpilot.collectors.nvml import NvmlCollector
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.collectors.vllm_metrics import VllmScrape

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Observed:
    """One server as this tick read it: the snapshot, and its ticker's windows and figures."""

    instance: Instance
    snapshot: Snapshot
    ticker: Ticker


class WatchedServers:
    """Each watched server's ticker and client; the latest NVML reading of the host."""

    def __init__(
        self,
        settings: TickSettings,
        nvml: NvmlCollector,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tick = settings
        self._nvml = nvml
        self.clock = clock
        self._tls = ssl.create_default_context()  # loaded once, shared by the servers' clients
        self._tickers: dict[str, Ticker] = {}
        self._clients: dict[str, ScrapeClient] = {}
        self._instances: dict[str, Instance] = {}
        # The (vLLM, kvpool) addresses each ticker reads: the runtime may learn them late
        # (a pod's IP once scheduled, a kvpool port once the engine serves it).
        self._addresses: dict[str, tuple[str, str | None]] = {}
        self._latest_nvml: NvmlSnapshot | SourceError | None = None
        self._dcgm_client: ScrapeClient | None = None
        self._dcgm = self._dcgm_source()

    def _dcgm_source(self) -> DcgmSource | None:
        """dcgm-exporter's memory of this pod's GPUs, through Prometheus, when configured."""
        section = self._tick.gpu
        if section.dcgm_prometheus_url is None:
            return None
        pod, namespace = section.pod_identity(os.environ)
        self._dcgm_client = ScrapeClient(ssl_context=self._tls)
        return DcgmSource(
            section.dcgm_prometheus_url,
            pod=pod,
            namespace=namespace,
            client=self._dcgm_client,
            limits=self._tick.scrape_limits,
            clock=self.clock,
        )

    async def _read_gpus(self) -> NvmlReading:
        """NVML, and dcgm-exporter beside it when configured: once per tick for every server."""
        if self._dcgm is None:
            return await read_nvml(self._nvml, self.clock)
        nvml, (dcgm, duration_s) = await asyncio.gather(
            read_nvml(self._nvml, self.clock), self._timed_dcgm(self._dcgm)
        )
        return dataclasses.replace(nvml, dcgm=dcgm, dcgm_duration_s=duration_s)

    async def _timed_dcgm(self, source: DcgmSource) -> tuple[DcgmSnapshot | SourceError, float]:
        start = self.clock()
        value = await source.read()
        return value, self.clock() - start

    async def observe(self, instances: Sequence[Instance], tasks: GuardedTasks) -> list[Observed]:
        """One NVML reading, then every listed server's sources concurrently. A server no
        longer listed (a canary removed) is forgotten, its client closed in `tasks`."""
        self._forget_except({i.name for i in instances}, tasks)
        nvml = await self._read_gpus()
        self._latest_nvml = nvml.value
        return list(await asyncio.gather(*(self._read(i, nvml) for i in instances)))

    async def _read(self, instance: Instance, nvml: NvmlReading) -> Observed:
        ticker = self._ticker(instance)
        self._instances[instance.name] = instance
        return Observed(instance, await ticker.tick(nvml), ticker)

    def _forget_except(self, names: set[str], tasks: GuardedTasks) -> None:
        for name in set(self._tickers) - names:
            del self._tickers[name]
            self._instances.pop(name, None)
            self._addresses.pop(name, None)
            client = self._clients.pop(name, None)
            if client is not None:
                tasks.spawn(client.aclose(), f"close-client-{name}")

    def _ticker(self, instance: Instance) -> Ticker:
        """The server's ticker, reading the addresses the runtime lists this tick."""
        addresses = (instance.url, instance.kvpool_url)
        ticker = self._tickers.get(instance.name)
        if ticker is None:
            # A client per server: one pool's connection scan grows with every server
            # watched, and that cost is paid on every request of every server.
            client = ScrapeClient(ssl_context=self._tls)
            self._clients[instance.name] = client
            ticker = build_ticker(self._settings(instance), client)
            self._tickers[instance.name] = ticker
        elif self._addresses.get(instance.name) != addresses:
            log.info("server %s: its addresses changed; reading the new ones", instance.name)
            client = self._clients[instance.name]
            ticker.use_taker(build_taker(self._settings(instance), client))
        self._addresses[instance.name] = addresses
        return ticker

    def _settings(self, instance: Instance) -> CollectSettings:
        api_key = self._tick.runtime.api_key
        return CollectSettings(
            vllm_url=instance.url,
            kvpool_url=instance.kvpool_url,
            api_key=api_key.get_secret_value() if api_key else None,
            limits=self._tick.scrape_limits,
            model_config=instance.model_config or model_config_of(instance.argv),
        )

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
        if self._dcgm_client is not None:
            await self._dcgm_client.aclose()

    # -- what the rest of the agent reads between ticks --------------------------------

    def servers(self) -> list[ServerView]:
        return [
            ServerView(
                name,
                instance.role if (instance := self._instances.get(name)) else "stable",
                ticker.state,
                instance.pids if instance else frozenset(),
            )
            for name, ticker in self._tickers.items()
        ]

    def latest_nvml(self) -> NvmlSnapshot | SourceError | None:
        return self._latest_nvml

    def latest_vllm(self, name: str) -> VllmScrape | None:
        ticker = self._tickers.get(name)
        latest = ticker.state.latest if ticker else None
        return latest.vllm if latest and isinstance(latest.vllm, VllmScrape) else None

    def cache_config(self, name: str) -> Labels | None:
        """The server's `vllm:cache_config_info` labels, for the memory pre-flight."""
        scrape = self.latest_vllm(name)
        return scrape.engines[0].cache_config if scrape and scrape.engines else None

    def vllm_version(self, name: str | None) -> str | None:
        """The vLLM version server `name` reported at its last scrape; None while unknown."""
        scrape = self.latest_vllm(name) if name is not None else None
        return scrape.vllm_version if scrape is not None else None
