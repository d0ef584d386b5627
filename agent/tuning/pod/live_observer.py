"""The tuner's Observer on live traffic: a share of real requests goes to the canary, and
each pod is judged from its own /metrics (see `live_intervals` for the figures).

`warm` sends the configured share to the canary through a `TrafficSplit` and waits
`warmup_s`: the canary's caches warm on real traffic and nothing is judged. The baseline is
the stable pod over the same analysis window, which starts once the canary is warm (as cold
as the canary: both are measured from the same moment, on the same traffic mix; a fresh
baseline pod would need a third server). `observe` scrapes both pods every
`analysis_interval_s` for `analysis_s`, on the same ticks, and gives the judge each
side's intervals (`Observation.intervals`: the two sides' intervals of the same ticks are
judged as pairs). A canary interval that breaks the SLO's latency or error limits, or
preemptions per request above the SLO's over the analysis so far (once it holds enough
finished requests to say), or a canary that restarted (its counters went back to zero) or
whose /metrics did not answer CANARY_UNANSWERED_LIMIT scrapes running, or whose container
the kubelet restarted since the warm-up began (`restarts`: the pods' `restartCount`, which
sees a crash the counters hide) is a crash: it is not judged on the readings that survived;
the traffic goes back to the stable pod at once and `CanaryAborted` is raised. With one URL
(the bake, after a promotion) it waits `warmup_s`, then watches the stable pod for `bake_s`:
the rolling update has just replaced that pod, its caches are as cold as a canary's were,
and the users who queued during the update arrive at once. Each observation states the
share each side was given and the share of finished requests each side served.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from kvpilot.agent.config.tuning import CanaryConfig
from kvpilot.agent.runtimes.base import RuntimeFailure
from kvpilot.agent.runtimes.kubernetes.traffic import Shares, TrafficSplit
from kvpilot.agent.tuning.pod.live_intervals import (
    PodReading,
    interval_samples,
    intervals,
    judge_samples,
    preemption_breach,
    read_pod,
    restarted,
)
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.limits import ScrapeLimits
from kvpilot.collectors.promtext import MetricsParseError
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.tuner.problem.objective import Measurement, Slo, server_kv_budget_bytes
from kvpilot.tuner.rollout.ports import CanaryAborted, Observation
from kvpilot.tuner.trials import Warmup


class LiveTrafficError(RuntimeError):
    """The split does not send the side to be judged any traffic."""


# A canary whose /metrics does not answer this many scrapes in a row has crashed (or is
# being replaced): it is not judged on the readings that survived.
CANARY_UNANSWERED_LIMIT = 2


class Unanswered(str):
    """Why a scrape failed, where the pod did not answer (or answered with an error status):
    unlike a body that does not parse, a sign that the pod is down."""


Sleep = Callable[[float], Awaitable[None]]


class LiveTrafficObserver:
    """The Observer over live traffic, scraping each pod's /metrics (see the module doc)."""

    def __init__(
        self,
        canary: CanaryConfig,
        traffic: TrafficSplit,
        slo: Slo,
        *,
        api_key: str | None = None,
        limits: ScrapeLimits | None = None,
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        restarts: Callable[[], int | None] | None = None,
    ) -> None:
        self._canary = canary
        self._restarts = restarts  # the canary container's restart count (blocking)
        self._restarts_from: int | None = None  # as the trial's warm-up began
        self._traffic = traffic
        self._slo = slo
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._limits = limits or ScrapeLimits()
        self._sleep = sleep
        self._clock = clock
        self._wall = wall_clock
        self.scrape_errors: list[str] = []  # counted and kept: a missing reading is not a zero

    async def warm(self, urls: Sequence[str]) -> Warmup | None:
        """Send the canary its share and let it warm for `warmup_s` (not judged)."""
        if len(urls) < 2:
            return None  # one instance (a bake): it already serves everything
        self._restarts_from = await self._restart_count()
        shares = await self._traffic.send_share(self._canary.weight_percent)
        if shares.canary_percent <= 0:
            raise LiveTrafficError(f"the split sends the canary nothing ({describe(shares)})")
        await self._sleep(self._canary.warmup_s)
        return Warmup(seconds=self._canary.warmup_s)

    async def observe(
        self, urls: Sequence[str], *, prompts: str | None = None
    ) -> tuple[Observation, ...]:
        if len(urls) == 1:
            return (await self._bake(urls[0]),)
        if len(urls) != 2:
            raise ValueError(f"live traffic judges a stable and a canary URL, got {len(urls)}")
        return await self._analysis(urls[0], urls[1])

    # --- the two windows ----------------------------------------------------------------

    async def _analysis(self, stable_url: str, canary_url: str) -> tuple[Observation, ...]:
        shares = await self._traffic.shares()
        if shares.canary_percent <= 0 or shares.stable_percent <= 0:
            raise LiveTrafficError(f"both sides need traffic to be judged ({describe(shares)})")
        count = max(1, round(self._canary.analysis_s / self._canary.analysis_interval_s))
        stable: list[PodReading] = []
        canary: list[PodReading] = []
        stable_ticks: list[int] = []  # the tick of each reading kept: the intervals' pairs
        canary_ticks: list[int] = []
        unanswered = 0  # the canary's scrapes in a row that got no answer
        first, self._restarts_from = self._restarts_from, None
        async with ScrapeClient() as client:
            async for tick in self._ticks(count):
                got_stable, got_canary, restarts = await asyncio.gather(
                    self._read(client, stable_url),
                    self._read(client, canary_url),
                    self._restart_count(),
                )
                _append(stable, stable_ticks, tick, got_stable)
                unanswered = unanswered + 1 if isinstance(got_canary, Unanswered) else 0
                breach = _restart_breach(first, restarts)
                first = restarts if first is None else first
                if breach is not None:
                    pass
                elif unanswered >= CANARY_UNANSWERED_LIMIT:
                    breach = f"the canary's /metrics did not answer {unanswered} times running"
                elif _append(canary, canary_ticks, tick, got_canary) and len(canary) >= 2:
                    (last,) = intervals(canary[-2:])
                    breach = last.slo_breach(self._slo) or preemption_breach(
                        intervals(canary), self._slo
                    )
                    if restarted(canary[-2], canary[-1]):
                        breach = "the canary restarted (its counters went back to zero)"
                if breach is not None:
                    back = await self._traffic.pull_back()
                    raise CanaryAborted(
                        f"canary interval {tick} of {count} broke the SLO: {breach}; "
                        f"traffic back to stable ({describe(back)}); during the analysis "
                        f"{describe(shares)}"
                    )
        said = _traffic_statement(shares, stable, canary)
        return (
            self._observation(stable_url, stable, stable_ticks, shares.stable_percent, said),
            self._observation(canary_url, canary, canary_ticks, shares.canary_percent, said),
        )

    async def _bake(self, url: str) -> Observation:
        shares = await self._traffic.shares()
        if shares.stable_percent <= 0:
            raise LiveTrafficError(
                f"the stable pod gets no traffic to bake on ({describe(shares)})"
            )
        await self._sleep(self._canary.warmup_s)
        count = max(1, round(self._canary.bake_s / self._canary.analysis_interval_s))
        readings: list[PodReading] = []
        ticks: list[int] = []
        async with ScrapeClient() as client:
            async for tick in self._ticks(count):
                _append(readings, ticks, tick, await self._read(client, url))
        said = f"bake after a {self._canary.warmup_s:g} s warm-up: {describe(shares)}"
        # No intervals: the bake has no side running beside it to pair them with.
        return self._observation(url, readings, None, shares.stable_percent, said)

    async def _ticks(self, count: int) -> AsyncIterator[int]:
        """Ticks 0..count, `analysis_interval_s` apart from the first (not drifting with the
        time each reading takes)."""
        started = self._clock()
        for tick in range(count + 1):
            if tick:
                wait = started + tick * self._canary.analysis_interval_s - self._clock()
                await self._sleep(max(0.0, wait))
            yield tick

    def _observation(
        self,
        url: str,
        readings: list[PodReading],
        ticks: list[int] | None,
        percent: float,
        said: str,
    ) -> Observation:
        """The side's window; `ticks`: its readings' scrape ticks, for the judge's pairs of
        intervals (None: not judged by intervals)."""
        share = percent / 100.0
        scrapes = tuple(r.scrape for r in readings)
        measurement = Measurement(
            scrapes=scrapes,
            memory_bytes=server_kv_budget_bytes(scrapes),
            traffic_share_ratio=share,
        )
        samples = judge_samples(intervals(readings), readings, share, self._slo)
        by_interval = None if ticks is None else interval_samples(ticks, readings, share, self._slo)
        return Observation(url, measurement, samples, traffic=said, intervals=by_interval)

    # --- one scrape ---------------------------------------------------------------------

    async def _read(self, client: ScrapeClient, base_url: str) -> PodReading | str:
        """One reading of a pod's /metrics, or why there is none."""
        url = base_url.rstrip("/") + "/metrics"
        taken, wall = self._clock(), self._wall()
        got = await client.get(url, source="vllm", limits=self._limits, headers=self._headers)
        if isinstance(got, SourceError):
            return Unanswered(self._error(f"{url}: {got.message}"))
        if got.status_code != 200:
            return Unanswered(self._error(f"{url} answered HTTP {got.status_code}"))
        try:
            reading = read_pod(
                got.text,
                taken_at_s=taken,
                wall_time_s=wall,
                sample_limit=self._limits.sample_limit,
            )
        except MetricsParseError as exc:
            return self._error(f"{url} does not parse: {exc}")
        if reading is None:
            return self._error(f"{url} exports no vllm: metrics (--disable-log-stats?)")
        return reading

    async def _restart_count(self) -> int | None:
        """The canary's restarts now; None when not read (no reader, or the read failed:
        counted in `scrape_errors`, unknown rather than zero)."""
        if self._restarts is None:
            return None
        try:
            return await asyncio.to_thread(self._restarts)
        except RuntimeFailure as exc:
            self._error(f"the canary's restartCount: {exc}")
            return None

    def _error(self, message: str) -> str:
        self.scrape_errors.append(message)
        return message


def describe(shares: Shares) -> str:
    """The split in words: 'stable 90 %, canary 10 % (HTTPRoute weights)'."""
    return (
        f"stable {shares.stable_percent:.3g} %, canary {shares.canary_percent:.3g} % ({shares.how})"
    )


def _restart_breach(first: int | None, now: int | None) -> str | None:
    """Why the canary is a crash by its restart count, or None (not risen, or unknown)."""
    if first is None or now is None or now <= first:
        return None
    return (
        f"the canary's container restarted {now - first} times during the trial "
        f"(restartCount {first} -> {now})"
    )


def _append(readings: list[PodReading], ticks: list[int], tick: int, got: PodReading | str) -> bool:
    """Keeps a reading and its tick (a failed one is left out, so the next interval spans
    the gap, and is paired with no interval of the other side)."""
    if isinstance(got, str):
        return False
    readings.append(got)
    ticks.append(tick)
    return True


def _traffic_statement(
    shares: Shares, stable: Sequence[PodReading], canary: Sequence[PodReading]
) -> str:
    """The share each side was given and the share of finished requests each served."""
    done_stable = sum(i.finished for i in intervals(stable))
    done_canary = sum(i.finished for i in intervals(canary))
    total = done_stable + done_canary
    served = (
        f"finished requests: stable {done_stable:g} ({done_stable / total:.0%}), "
        f"canary {done_canary:g} ({done_canary / total:.0%})"
        if total
        else "no request finished on either side"
    )
    return f"traffic {describe(shares)}; {served}"
