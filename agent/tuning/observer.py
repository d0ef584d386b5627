"""The tuner's Observer over the shared load generator: the same workload against each URL,
with /metrics scraped during the window, and the judge's samples from both."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import replace

import httpx

from kvpilot.collectors.vllm_metrics import VllmMetricsSource, VllmScrape
from kvpilot.tuner.loadgen import LoadReport, Workload, run_load
from kvpilot.tuner.objective import Measurement
from kvpilot.tuner.ports import Observation
from kvpilot.tuner.trials import Warmup


class LoadObserver:
    """The Observer over the shared load generator, with /metrics scraped during the window."""

    def __init__(
        self,
        workload: Workload,
        *,
        model: str,
        warm_requests: int = 2,
        scrape_interval_s: float = 0.25,  # short windows still give the judge a dozen scrapes
        api_key: str | None = None,
    ) -> None:
        self._workload = workload
        self._model = model
        self._warm = warm_requests
        self._interval_s = scrape_interval_s
        self._api_key = api_key

    async def warm(self, urls: Sequence[str]) -> Warmup:
        small = replace(
            self._workload, num_requests=self._warm, concurrency=self._warm, rate_rps=None
        )
        await asyncio.gather(
            *(run_load(u, small, model=self._model, api_key=self._api_key) for u in urls)
        )
        return Warmup(requests=self._warm)

    async def observe(self, urls: Sequence[str]) -> tuple[Observation, ...]:
        async with httpx.AsyncClient() as client:
            return tuple(await asyncio.gather(*(self._one(client, u) for u in urls)))

    async def _one(self, client: httpx.AsyncClient, url: str) -> Observation:
        source = VllmMetricsSource(url, client=client, api_key=self._api_key)
        scrapes: list[VllmScrape] = []
        done = asyncio.Event()

        async def scrape_until_done() -> None:
            while True:
                got = await source.scrape()
                if isinstance(got, VllmScrape):
                    scrapes.append(got)
                if done.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), self._interval_s)

        scraper = asyncio.create_task(scrape_until_done())
        try:
            report = await run_load(url, self._workload, model=self._model, api_key=self._api_key)
        finally:
            done.set()
            await scraper
        return Observation(
            url, Measurement(report=report, scrapes=tuple(scrapes)), samples(report, scrapes)
        )


def samples(report: LoadReport, scrapes: Sequence[VllmScrape]) -> dict[str, tuple[float, ...]]:
    """The judge's samples: per-request latencies and errors; per-interval preemptions,
    generation rate (goodput) and KV usage (shown, not counted)."""
    out: dict[str, tuple[float, ...]] = {
        "ttft_s": tuple(report.ttfts_s()),
        "inter_token_s": tuple(report.inter_tokens_s()),
        "e2e_s": tuple(report.e2es_s()),
        "errors_ratio": tuple(0.0 if r.ok else 1.0 for r in report.results),
    }
    rates, tokens, usage = [], [], []
    for a, b in itertools.pairwise(scrapes):
        span = b.taken_at_s - a.taken_at_s
        pa = _sum(e.preemptions_total for e in a.engines)
        pb = _sum(e.preemptions_total for e in b.engines)
        if span > 0 and pa is not None and pb is not None:
            rates.append(max(0.0, pb - pa) / span)  # a reset counts as no preemption
        ga = _sum(e.generation_tokens_total for e in a.engines)
        gb = _sum(e.generation_tokens_total for e in b.engines)
        if span > 0 and ga is not None and gb is not None:
            tokens.append(max(0.0, gb - ga) / span)
    for scrape in scrapes:
        u = [e.kv_usage_ratio for e in scrape.engines if e.kv_usage_ratio is not None]
        if u:
            usage.append(max(u))
    out["preemptions_per_s"] = tuple(rates)
    out["goodput_tokens_per_s"] = tuple(tokens)
    out["kv_usage_ratio"] = tuple(usage)
    return out


def _sum(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None
