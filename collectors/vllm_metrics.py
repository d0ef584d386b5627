"""vLLM's ``/metrics``: the async source that scrapes it within its limits, and (from
``collectors.vllm_parse``) the immutable samples it returns.

A payload without any ``vllm:`` family comes from a server started with
``--disable-log-stats``: the source reports ``stats_disabled``, never zeros. A body past
the deadline, the size cap or the sample limit is a ``timeout``, ``too_large`` or
``too_many_samples`` error for that scrape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvpilot.collectors import json_body
from kvpilot.collectors.errors import ErrorKind, SourceError
from kvpilot.collectors.limits import ScrapeLimits
from kvpilot.collectors.promtext import MetricsParseError, SampleLimitError
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.collectors.secrets import mask_url
from kvpilot.collectors.vllm_parse import EngineKey, EngineSample, VllmScrape, parse_vllm_metrics

__all__ = [
    "SOURCE",
    "EngineKey",
    "EngineSample",
    "VllmMetricsSource",
    "VllmScrape",
    "parse_vllm_metrics",
]

SOURCE = "vllm"
VERSION_BODY_LIMIT_BYTES = 64 * 1024  # /version is a few bytes of JSON


class VllmMetricsSource:
    """Scrapes one vLLM server's ``/metrics``; every failure comes back as a ``SourceError``.

    ``/version`` is read once and cached; it is read again after a failed scrape, since
    the server may have been restarted with another version.
    """

    def __init__(
        self,
        base_url: str,
        *,
        client: ScrapeClient,
        limits: ScrapeLimits | None = None,
        api_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._shown_url = mask_url(self.metrics_url)  # what messages say: no secrets in it
        self._client = client
        self._limits = limits or ScrapeLimits()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clock = clock
        self._wall_clock = wall_clock
        self._version: str | None = None
        self._version_known = False

    @property
    def metrics_url(self) -> str:
        """Where the metrics are read."""
        return self._base_url + "/metrics"

    async def scrape(self) -> VllmScrape | SourceError:
        """Read ``/metrics`` once (stamped when the request starts); never raises. The deadline
        covers the whole scrape: ``/version``, when it is read, gets what time is left."""
        taken_at_s = self._clock()
        wall_time_s = self._wall_clock()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._limits.timeout_s
        result = await self._fetch_metrics()
        if isinstance(result, SourceError):
            self._version_known = False
            return result
        try:
            engines = parse_vllm_metrics(
                result,
                taken_at_s=taken_at_s,
                wall_time_s=wall_time_s,
                sample_limit=self._limits.sample_limit,
            )
        except SampleLimitError as e:
            self._version_known = False
            return self._error("too_many_samples", f"{self._shown_url}: {e} (the sample limit)")
        except MetricsParseError as e:
            self._version_known = False
            return self._error("parse_error", f"{self._shown_url} does not parse: {e}")
        except ArithmeticError as e:  # a number no check foresaw must not stop the tick
            self._version_known = False
            return self._error(
                "parse_error", f"{self._shown_url}: a value out of range: {type(e).__name__}"
            )
        if not engines:
            return self._error(
                "stats_disabled",
                f"{self._shown_url} exports no vllm: metrics; the server was probably "
                "started with --disable-log-stats, so KV usage, queues and latencies are unknown",
            )
        left_s = deadline - loop.time()
        if not self._version_known and left_s > 0:
            await self._fetch_version(left_s)
        return VllmScrape(
            taken_at_s=taken_at_s,
            wall_time_s=wall_time_s,
            engines=engines,
            vllm_version=self._version,
        )

    async def _fetch_metrics(self) -> str | SourceError:
        """The body of ``/metrics``, or why there is none."""
        url = self._shown_url
        got = await self._client.get(
            self.metrics_url, source=SOURCE, limits=self._limits, headers=self._headers
        )
        if isinstance(got, SourceError):
            return got
        body = got.text
        if got.status_code != 200:
            return self._error(
                "http_status", f"{url} answered HTTP {got.status_code}: {_excerpt(body)}"
            )
        head = body.lstrip()[:1]
        if "html" in got.content_type or head in ("<", "{", "["):
            return self._error(
                "not_metrics",
                f"{url} answered {got.content_type or 'no content type'} that is not a "
                f"Prometheus exposition: {_excerpt(body)}",
            )
        if not head:
            return self._error("not_metrics", f"{url} answered an empty body")
        return body

    async def _fetch_version(self, timeout_s: float) -> None:
        """Learn the server's version from ``/version``; a failure leaves it unknown."""
        limits = ScrapeLimits(timeout_s=timeout_s, body_size_limit_bytes=VERSION_BODY_LIMIT_BYTES)
        got = await self._client.get(
            self._base_url + "/version",
            source=SOURCE,
            limits=limits,
            headers=self._headers,
        )
        if isinstance(got, SourceError) and got.kind in ("timeout", "refused", "error"):
            return  # transient: asked again at the next scrape
        self._version_known = True
        self._version = None
        if isinstance(got, SourceError) or got.status_code != 200:
            return
        try:
            answer = json_body.loads(got.text)
        except json_body.JsonBodyError:
            return
        version = answer.get("version") if isinstance(answer, dict) else None
        if isinstance(version, str):
            self._version = version

    def _error(self, kind: ErrorKind, message: str) -> SourceError:
        return SourceError(source=SOURCE, kind=kind, message=message)


def _excerpt(body: str, limit: int = 120) -> str:
    """The start of a body on one line, for messages."""
    flat = " ".join(body.split())
    return repr(flat[:limit] + ("..." if len(flat) > limit else ""))
