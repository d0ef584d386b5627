"""vLLM's ``/metrics`` as one immutable sample per engine, and the async source that scrapes it.

Families are read by name and label (vLLM 0.32, v1 engine, with the older names accepted);
unknown families are ignored and missing ones give None. A payload without any ``vllm:``
family comes from a server started with ``--disable-log-stats``: the parser returns no
engines and the source reports ``stats_disabled``, never zeros.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import httpx

from kvpilot.collectors.errors import ErrorKind, SourceError
from kvpilot.collectors.histogram import Histogram
from kvpilot.collectors.promtext import Labels, MetricsParseError, scan

SOURCE = "vllm"

EngineKey = tuple[str, str]  # (model_name, engine)

# Family name -> EngineSample field. Where a field has an older name too, the first
# listed wins when a server exports both.
_GAUGES: dict[str, str] = {
    "vllm:kv_cache_usage_perc": "kv_usage_ratio",  # a 0..1 ratio despite the name
    "vllm:gpu_cache_usage_perc": "kv_usage_ratio",  # v0 and early v1
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
}
_COUNTERS: dict[str, str] = {
    "vllm:num_preemptions_total": "preemptions_total",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total": "prefix_cache_queries_total",  # early v1
    "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits_total": "prefix_cache_hits_total",  # early v1
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
}
_HISTOGRAMS: dict[str, str] = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "inter_token_latency",
    "vllm:time_per_output_token_seconds": "inter_token_latency",  # before 0.9
    "vllm:e2e_request_latency_seconds": "e2e_latency",
    "vllm:request_queue_time_seconds": "queue_time",
    "vllm:request_prefill_time_seconds": "prefill_time",
    "vllm:request_decode_time_seconds": "decode_time",
    # Its name ends in _total although it is a histogram; its _count is the step counter.
    "vllm:iteration_tokens_total": "iteration_tokens",
}
_CACHE_CONFIG = "vllm:cache_config_info"
_PRIORITY = {name: i for i, name in enumerate([*_GAUGES, *_COUNTERS, *_HISTOGRAMS])}
# Sample name -> (part, field, family). Parts: "value" for gauges and counters, else the
# histogram's "bucket", "sum" or "count".
_DISPATCH: dict[str, tuple[str, str, str]] = {
    **{n: ("value", f, n) for n, f in (*_GAUGES.items(), *_COUNTERS.items())},
    **{
        f"{n}_{part}": (part, f, n)
        for n, f in _HISTOGRAMS.items()
        for part in ("bucket", "sum", "count")
    },
}
# Family names: every other line is skipped before its labels are read. (A family name also
# matches its _created and *_by_reason cousins; those few lines are parsed and ignored.)
_PREFIXES: tuple[str, ...] = (*_GAUGES, *_COUNTERS, *_HISTOGRAMS, _CACHE_CONFIG)


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One engine's state at one scrape. Counters are cumulative since the server started.

    ``blocks_total`` is the engine's usable KV blocks: ``num_gpu_blocks`` (as exported: the
    sum over the data-parallel engines, null blocks included) divided over the engines in
    the payload, minus the one reserved null block each. ``blocks_free`` inverts vLLM's
    ``usage = 1 - free / (blocks - 1)``: ``round(blocks_total * (1 - kv_usage_ratio))``;
    prefix-cached blocks that could be evicted count as free, as they do in vLLM.
    """

    model_name: str
    engine: str
    taken_at_s: float  # monotonic
    wall_time_s: float  # for display and storage only
    kv_usage_ratio: float | None = None
    num_gpu_blocks: int | None = None
    blocks_total: int | None = None
    blocks_free: int | None = None
    block_size: int | None = None
    cache_config: tuple[tuple[str, str], ...] = ()
    requests_running: int | None = None
    requests_waiting: int | None = None
    preemptions_total: float | None = None
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    iterations_total: float | None = None  # engine steps: the progress heartbeat
    ttft: Histogram | None = None
    inter_token_latency: Histogram | None = None
    e2e_latency: Histogram | None = None
    queue_time: Histogram | None = None
    prefill_time: Histogram | None = None
    decode_time: Histogram | None = None
    iteration_tokens: Histogram | None = None

    @property
    def key(self) -> EngineKey:
        """The engine's identity across scrapes."""
        return (self.model_name, self.engine)


@dataclass(frozen=True, slots=True)
class VllmScrape:
    """One successful scrape: every engine the server reported, and the server's version."""

    taken_at_s: float
    wall_time_s: float
    engines: tuple[EngineSample, ...]
    vllm_version: str | None


class _Hist:
    """Histogram parts gathered while scanning."""

    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.buckets: list[tuple[float, float]] = []
        self.sum: float | None = None
        self.count: float | None = None

    def build(self) -> Histogram | None:
        if not self.buckets or self.sum is None:
            return None
        self.buckets.sort()
        if self.buckets[-1][0] != math.inf:
            return None
        count = self.count if self.count is not None else self.buckets[-1][1]
        return Histogram(buckets=tuple(self.buckets), sum=self.sum, count=count)


def parse_vllm_metrics(
    text: str, *, taken_at_s: float, wall_time_s: float
) -> tuple[EngineSample, ...]:
    """One ``EngineSample`` per ``(model_name, engine)``; empty when there is no ``vllm:`` family.

    Raises ``MetricsParseError`` on text that is not an exposition.
    """
    values: dict[EngineKey, dict[str, float]] = {}
    ranks: dict[tuple[EngineKey, str], int] = {}
    hists: dict[tuple[EngineKey, str, str], _Hist] = {}
    cache_infos: dict[str | None, Labels] = {}
    keys: dict[Labels, tuple[EngineKey, str | None]] = {}
    for name, labels, value in scan(text, prefixes=_PREFIXES):
        target = _DISPATCH.get(name)
        if target is None:
            if name == _CACHE_CONFIG:
                cache_infos[dict(labels).get("engine")] = labels
            continue
        ident = keys.get(labels)
        if ident is None:
            ident = keys[labels] = _identity(labels)
        key, le = ident
        part, field, family = target
        if part == "value":
            rank = _PRIORITY[family]
            if ranks.get((key, field), rank + 1) > rank:
                ranks[(key, field)] = rank
                values.setdefault(key, {})[field] = value
            continue
        if key not in values:
            values[key] = {}
        h = hists.get((key, field, family))
        if h is None:
            h = hists[(key, field, family)] = _Hist()
        if part == "bucket":
            if le is None:
                raise MetricsParseError(f"{name} without an le label")
            h.buckets.append((_le(le, name), value))
        elif part == "sum":
            h.sum = value
        else:
            h.count = value
    if not values:
        return _without_known_families(text, cache_infos, taken_at_s, wall_time_s)
    return _assemble(values, hists, cache_infos, taken_at_s, wall_time_s)


def _identity(labels: Labels) -> tuple[EngineKey, str | None]:
    """The engine key and the ``le`` label of one label set."""
    model, engine, le = "", "0", None
    for k, v in labels:
        if k == "model_name":
            model = v
        elif k == "engine":
            engine = v
        elif k == "le":
            le = v
    return (model, engine), le


def _le(text: str, name: str) -> float:
    """A bucket bound."""
    try:
        return float(text)
    except ValueError:
        raise MetricsParseError(f"{name} has an invalid le {text[:20]!r}") from None


def _assemble(
    values: dict[EngineKey, dict[str, float]],
    hists: dict[tuple[EngineKey, str, str], _Hist],
    cache_infos: dict[str | None, Labels],
    taken_at_s: float,
    wall_time_s: float,
) -> tuple[EngineSample, ...]:
    """Build the samples once every line has been read."""
    chosen: dict[tuple[EngineKey, str], tuple[int, Histogram]] = {}
    for (key, family, base), parts in hists.items():
        h = parts.build()
        rank = _PRIORITY[base]
        if h is not None and chosen.get((key, family), (rank + 1,))[0] > rank:
            chosen[(key, family)] = (rank, h)
    n_engines = len({engine for _, engine in values})
    out = []
    for key in sorted(values):
        fields: dict[str, object] = dict(values[key])
        for name in ("requests_running", "requests_waiting"):
            if name in fields:
                fields[name] = _count_or_none(values[key][name])
        usage = values[key].get("kv_usage_ratio")
        if usage is not None and math.isnan(usage):
            fields["kv_usage_ratio"] = usage = None
        for (k, family), (_, h) in chosen.items():
            if k == key:
                fields[family] = h
        iterations = fields.get("iteration_tokens")
        if isinstance(iterations, Histogram):
            fields["iterations_total"] = iterations.count
        info = cache_infos.get(key[1]) or cache_infos.get(None) or ()
        fields.update(_cache_fields(info, n_engines, usage))
        out.append(
            EngineSample(
                model_name=key[0],
                engine=key[1],
                taken_at_s=taken_at_s,
                wall_time_s=wall_time_s,
                **fields,  # type: ignore[arg-type]  # keys are EngineSample's own field names
            )
        )
    return tuple(out)


class _CacheFields(TypedDict):
    cache_config: Labels
    num_gpu_blocks: int | None
    blocks_total: int | None
    blocks_free: int | None
    block_size: int | None


def _cache_fields(info: Labels, n_engines: int, usage: float | None) -> _CacheFields:
    """Block figures from ``vllm:cache_config_info``'s labels and the usage ratio."""
    labels = dict(info)
    num_gpu_blocks = _int_label(labels.get("num_gpu_blocks"))
    blocks_total = None
    if num_gpu_blocks is not None and n_engines > 0 and num_gpu_blocks // n_engines > 1:
        blocks_total = num_gpu_blocks // n_engines - 1  # minus the null block
    blocks_free = None
    if blocks_total is not None and usage is not None and 0.0 <= usage <= 1.0:
        blocks_free = round(blocks_total * (1.0 - usage))
    return {
        "cache_config": tuple(info),
        "num_gpu_blocks": num_gpu_blocks,
        "blocks_total": blocks_total,
        "blocks_free": blocks_free,
        "block_size": _int_label(labels.get("block_size")),
    }


def _int_label(text: str | None) -> int | None:
    """An integer label value; None for absent, "None" and anything else that is no integer."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _count_or_none(value: float) -> int | None:
    """A gauge that counts things, as an int; None when it is not a finite number."""
    return int(value) if math.isfinite(value) else None


def _without_known_families(
    text: str, cache_infos: dict[str | None, Labels], taken_at_s: float, wall_time_s: float
) -> tuple[EngineSample, ...]:
    """The slow path when no family kvpilot reads was found: validate, then look for any engine."""
    engines: set[EngineKey] = set()
    for name, labels, _ in scan(text):  # a full parse: garbage raises here
        if name.startswith("vllm:") and name != _CACHE_CONFIG:
            engines.add(_identity(labels)[0])
    if not engines:
        engines = {("", engine or "0") for engine in cache_infos}
    n = len({e for _, e in engines})
    return tuple(
        EngineSample(
            model_name=model,
            engine=engine,
            taken_at_s=taken_at_s,
            wall_time_s=wall_time_s,
            **_cache_fields(cache_infos.get(engine) or cache_infos.get(None) or (), n, None),
        )
        for model, engine in sorted(engines)
    )


class VllmMetricsSource:
    """Scrapes one vLLM server's ``/metrics``; every failure comes back as a ``SourceError``.

    ``/version`` is read once and cached; it is read again after a failed scrape, since
    the server may have been restarted with another version.
    """

    def __init__(
        self,
        base_url: str,
        *,
        client: httpx.AsyncClient,
        timeout_s: float = 2.0,
        api_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._client = client
        self._timeout_s = timeout_s
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
        """Read ``/metrics`` once (stamped when the request starts); never raises."""
        taken_at_s = self._clock()
        wall_time_s = self._wall_clock()
        result = await self._fetch_metrics()
        if isinstance(result, SourceError):
            self._version_known = False
            return result
        try:
            engines = parse_vllm_metrics(result, taken_at_s=taken_at_s, wall_time_s=wall_time_s)
        except MetricsParseError as e:
            self._version_known = False
            return self._error("parse_error", f"{self.metrics_url} does not parse: {e}")
        if not engines:
            return self._error(
                "stats_disabled",
                f"{self.metrics_url} exports no vllm: metrics; the server was probably "
                "started with --disable-log-stats, so KV usage, queues and latencies are unknown",
            )
        if not self._version_known:
            await self._fetch_version()
        return VllmScrape(
            taken_at_s=taken_at_s,
            wall_time_s=wall_time_s,
            engines=engines,
            vllm_version=self._version,
        )

    async def _fetch_metrics(self) -> str | SourceError:
        """The body of ``/metrics``, or why there is none."""
        url = self.metrics_url
        try:
            async with asyncio.timeout(self._timeout_s):  # the whole exchange, not each read
                resp = await self._client.get(url, headers=self._headers, timeout=self._timeout_s)
                body = resp.text
        except (TimeoutError, httpx.TimeoutException):
            return self._error("timeout", f"{url} did not answer within {self._timeout_s:g} s")
        except httpx.ConnectError as e:
            return self._error("refused", f"cannot connect to {url}: {e or type(e).__name__}")
        except httpx.HTTPError as e:
            return self._error("error", f"{url}: {type(e).__name__}: {e}")
        except Exception as e:  # a scrape must never take the agent down; reported, not hidden
            return self._error("error", f"{url}: unexpected {type(e).__name__}: {e}")
        if resp.status_code != 200:
            return self._error(
                "http_status", f"{url} answered HTTP {resp.status_code}: {_excerpt(body)}"
            )
        content_type = resp.headers.get("content-type", "")
        head = body.lstrip()[:1]
        if "html" in content_type or head in ("<", "{", "["):
            return self._error(
                "not_metrics",
                f"{url} answered {content_type or 'no content type'} that is not a "
                f"Prometheus exposition: {_excerpt(body)}",
            )
        if not head:
            return self._error("not_metrics", f"{url} answered an empty body")
        return body

    async def _fetch_version(self) -> None:
        """Learn the server's version from ``/version``; a failure leaves it unknown."""
        try:
            async with asyncio.timeout(self._timeout_s):
                resp = await self._client.get(
                    self._base_url + "/version", headers=self._headers, timeout=self._timeout_s
                )
        except (TimeoutError, httpx.HTTPError):
            return  # transient: asked again at the next scrape
        self._version_known = True
        self._version = None
        if resp.status_code != 200:
            return
        try:
            version = resp.json().get("version")
        except (ValueError, AttributeError):
            return
        if isinstance(version, str):
            self._version = version

    def _error(self, kind: ErrorKind, message: str) -> SourceError:
        return SourceError(source=SOURCE, kind=kind, message=message)


def _excerpt(body: str, limit: int = 120) -> str:
    """The start of a body on one line, for messages."""
    flat = " ".join(body.split())
    return repr(flat[:limit] + ("..." if len(flat) > limit else ""))
