"""The tuner's Observer over the shared load generator: the same workload against each URL,
with /metrics scraped during the window, and the judge's samples from both.

Each window draws prompts of its own (seeded by the run's salt and the window), the same on
every side of it: vLLM caches prefixes by default, and a window that repeats the last one's
prompts would measure the cache the last window left. The warm-up sends prompts of its own.
Each side's foreign requests (finished on the server, not sent by the generator: users'
traffic on the serving instance) are counted from its `vllm:request_success_total`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.collectors.vllm_metrics import VllmMetricsSource, VllmScrape
from kvpilot.tuner.judge.evidence import Counts, Samples
from kvpilot.tuner.load.generator import LoadReport, Workload, for_window, run_load
from kvpilot.tuner.problem.objective import Measurement, server_kv_budget_bytes
from kvpilot.tuner.rollout.foreign import ForeignRequests
from kvpilot.tuner.rollout.ports import Observation
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
        device_memory: Callable[[str], int | None] = lambda _url: None,
        salt: int | None = None,
    ) -> None:
        """`salt`: the run's, mixed into every window's seed (None: a random one, so that
        no run replays an earlier run's prompts into a cache that may still hold them)."""
        self._workload = workload
        self._model = model
        self._warm = warm_requests
        self._interval_s = scrape_interval_s
        self._api_key = api_key
        self._device_memory = device_memory  # a server's device memory, by its URL
        self._salt = secrets.randbits(63) if salt is None else salt
        self._drawn = 0  # windows drawn without a name so far

    async def warm(self, urls: Sequence[str]) -> Warmup:
        small = replace(
            self.window_workload("warm-up"),
            num_requests=self._warm,
            concurrency=self._warm,
            rate_rps=None,
        )
        await asyncio.gather(
            *(run_load(u, small, model=self._model, api_key=self._api_key) for u in urls)
        )
        return Warmup(requests=self._warm)

    def window_workload(self, window: str) -> Workload:
        """The workload of one named window of this run."""
        return for_window(self._workload, salt=self._salt, window=window)

    async def observe(
        self, urls: Sequence[str], *, prompts: str | None = None
    ) -> tuple[Observation, ...]:
        if prompts is None:
            prompts = f"drawn {self._drawn}"
            self._drawn += 1
        workload = self.window_workload(prompts)
        async with ScrapeClient() as client:
            return tuple(await asyncio.gather(*(self._one(client, u, workload) for u in urls)))

    async def _one(self, client: ScrapeClient, url: str, workload: Workload) -> Observation:
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
            report = await run_load(url, workload, model=self._model, api_key=self._api_key)
        finally:
            done.set()
            await scraper
        memory = measured_memory(scrapes, url, self._device_memory)
        measurement = Measurement(report=report, scrapes=tuple(scrapes), memory_bytes=memory)
        foreign = foreign_requests(scrapes, own=len(report.results))
        return Observation(url, measurement, samples(report, scrapes), foreign=foreign)


def foreign_requests(scrapes: Sequence[VllmScrape], *, own: int) -> ForeignRequests | None:
    """The requests the server finished between the window's first and last scrape beyond
    the generator's `own` (every request it sent: vLLM counts aborted and failed ones too);
    None where the counter is missing or was reset (a restart) in between."""
    if len(scrapes) < 2:
        return None
    first = _sum(e.requests_success_total for e in scrapes[0].engines)
    last = _sum(e.requests_success_total for e in scrapes[-1].engines)
    if first is None or last is None or last < first:
        return None
    return ForeignRequests(foreign=max(0, round(last - first) - own), own=own)


def measured_memory(
    scrapes: Sequence[VllmScrape], url: str, device_memory: Callable[[str], int | None]
) -> int | None:
    """The memory a window is priced at: the KV budget the server reports, else (a budget
    sized by --gpu-memory-utilization reads "None") the device memory its processes hold."""
    budget = server_kv_budget_bytes(scrapes)
    return budget if budget is not None else device_memory(url)


def samples(report: LoadReport, scrapes: Sequence[VllmScrape]) -> dict[str, Samples]:
    """The judge's samples: per request its latencies (its own mean inter-token gap: a
    request's gaps are not independent of each other) and whether it failed; preemptions as
    a count over the window's seconds; per interval the generation rate (goodput) and KV
    usage (shown, not counted)."""
    ok = report.ok
    out: dict[str, Samples] = {
        "ttft_s": tuple(report.ttfts_s()),
        "inter_token_s": tuple(
            sum(r.inter_token_s) / len(r.inter_token_s) for r in ok if r.inter_token_s
        ),
        "e2e_s": tuple(report.e2es_s()),
        "errors_ratio": tuple(0.0 if r.ok else 1.0 for r in report.results),
    }
    preempted = exposure_s = 0.0
    counted = False
    tokens, usage = [], []
    for a, b in itertools.pairwise(scrapes):
        span = b.taken_at_s - a.taken_at_s
        pa = _sum(e.preemptions_total for e in a.engines)
        pb = _sum(e.preemptions_total for e in b.engines)
        if span > 0 and pa is not None and pb is not None:
            preempted += max(0.0, pb - pa)  # a reset counts as no preemption
            exposure_s += span
            counted = True
        ga = _sum(e.generation_tokens_total for e in a.engines)
        gb = _sum(e.generation_tokens_total for e in b.engines)
        if span > 0 and ga is not None and gb is not None:
            tokens.append(max(0.0, gb - ga) / span)
    for scrape in scrapes:
        u = [e.kv_usage_ratio for e in scrape.engines if e.kv_usage_ratio is not None]
        if u:
            usage.append(max(u))
    out["preemptions_per_s"] = Counts(preempted, exposure_s) if counted else ()
    out["goodput_tokens_per_s"] = tuple(tokens)
    out["kv_usage_ratio"] = tuple(usage)
    return out


def _sum(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None
