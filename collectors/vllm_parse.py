"""vLLM's ``/metrics`` text as one immutable, checked sample per engine.

Families are read by name and label (vLLM 0.32, v1 engine, with the older names accepted);
unknown families are ignored and missing ones give None. A payload without any ``vllm:``
family comes from a server started with ``--disable-log-stats``: the parser returns no
engines. Every value is checked at the edge (``collectors.checks``): a ratio outside 0..1,
a negative or non-finite counter, a series exported twice with different values become None
and are listed in the sample's ``refused``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TypedDict

from kvpilot.collectors.checks import Refused, SampleChecks, same_reading
from kvpilot.collectors.histogram import Histogram
from kvpilot.collectors.promtext import Labels, MetricsParseError, scan
from kvpilot.collectors.window import EngineKey as EngineKey

# Family name -> EngineSample field. Where a field has an older name too, the first
# listed wins when a server exports both.
_GAUGES: dict[str, str] = {
    "vllm:kv_cache_usage_perc": "kv_usage_ratio",  # a 0..1 ratio despite the name
    "vllm:gpu_cache_usage_perc": "kv_usage_ratio",  # v0 and early v1
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
    # One series per reason label; the scan renames them (see _by_reason).
    "vllm:num_requests_waiting_by_reason:capacity": "requests_waiting_capacity",
    "vllm:num_requests_waiting_by_reason:deferred": "requests_deferred",
}
_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
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
    # Per request, observed when it finishes: what a learned workload draws its lengths from.
    "vllm:request_prompt_tokens": "request_prompt_tokens",
    "vllm:request_generation_tokens": "request_generation_tokens",
    # Preemptions per finished request (thrash): its _sum and _count become counters.
    "vllm:request_num_preemptions": "request_preemptions",
}
# Counters exported once per finished_reason label: the field is their sum.
_SUMMED: dict[str, str] = {
    "vllm:request_success_total": "requests_success_total",
    # Counted in the API server per reason, without an engine label: it lands on engine "0".
    "vllm:admission_rejections_total": "admission_rejections_total",
}
_CACHE_CONFIG = "vllm:cache_config_info"
_FAMILIES = (*_GAUGES, *_COUNTERS, *_HISTOGRAMS, *_SUMMED)
_PRIORITY = {name: i for i, name in enumerate(_FAMILIES)}
_COUNTS = frozenset(
    {"requests_running", "requests_waiting", "requests_waiting_capacity", "requests_deferred"}
)
# Sample name -> (part, field, family). Parts: "value" for gauges and counters, else the
# histogram's "bucket", "sum" or "count".
_DISPATCH: dict[str, tuple[str, str, str]] = {
    **{n: ("value", f, n) for n, f in (*_GAUGES.items(), *_COUNTERS.items())},
    **{n: ("summed", f, n) for n, f in _SUMMED.items()},
    **{
        f"{n}_{part}": (part, f, n)
        for n, f in _HISTOGRAMS.items()
        for part in ("bucket", "sum", "count")
    },
}
# Family names: every other line is skipped before its labels are read. (A family name also
# matches its _created and *_by_reason cousins; those few lines are parsed and ignored.)
_PREFIXES: tuple[str, ...] = (*_GAUGES, *_COUNTERS, *_HISTOGRAMS, *_SUMMED, _CACHE_CONFIG)


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One engine's state at one scrape. Counters are cumulative since the server started.

    ``blocks_total`` is the engine's usable KV blocks: ``num_gpu_blocks`` (as exported: the
    sum over the data-parallel engines, null blocks included) divided over the engines in
    the payload, minus the one reserved null block each. ``blocks_free`` inverts vLLM's
    ``usage = 1 - free / (blocks - 1)``: ``round(blocks_total * (1 - kv_usage_ratio))``;
    prefix-cached blocks that could be evicted count as free, as they do in vLLM.
    ``refused`` lists the values the edge checks turned into None, with the reason.
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
    requests_waiting_capacity: int | None = None  # waiting for KV blocks or batch room
    requests_deferred: int | None = None  # held back by a transient constraint
    preemptions_total: float | None = None
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    iterations_total: float | None = None  # engine steps: the progress heartbeat
    requests_success_total: float | None = None  # finished requests, every finished_reason
    admission_rejections_total: float | None = None  # refused by a queue limit, every reason
    # From vllm:request_num_preemptions: preemptions of finished requests, and those requests.
    request_preemptions_sum: float | None = None
    request_preemptions_count: float | None = None
    ttft: Histogram | None = None
    inter_token_latency: Histogram | None = None
    e2e_latency: Histogram | None = None
    queue_time: Histogram | None = None
    prefill_time: Histogram | None = None
    decode_time: Histogram | None = None
    iteration_tokens: Histogram | None = None
    request_prompt_tokens: Histogram | None = None  # prompt length per finished request
    request_generation_tokens: Histogram | None = None  # output length per finished request
    request_preemptions: Histogram | None = None  # preemptions per finished request
    refused: tuple[Refused, ...] = ()

    @property
    def key(self) -> EngineKey:
        """The engine's identity across scrapes."""
        return (self.model_name, self.engine)


def kept_for_counters(sample: EngineSample) -> EngineSample:
    """What an old sample keeps once only its counters and gauges are read: its latency
    histograms and cache-config labels (the bulk of its memory) are dropped."""
    return replace(
        sample,
        cache_config=(),
        ttft=None,
        inter_token_latency=None,
        e2e_latency=None,
        queue_time=None,
        prefill_time=None,
        decode_time=None,
        iteration_tokens=None,
        request_prompt_tokens=None,
        request_generation_tokens=None,
        request_preemptions=None,
    )


@dataclass(frozen=True, slots=True)
class VllmScrape:
    """One successful scrape: every engine the server reported, and the server's version."""

    taken_at_s: float
    wall_time_s: float
    engines: tuple[EngineSample, ...]
    vllm_version: str | None


class _Hist:
    """Histogram parts gathered while scanning."""

    __slots__ = ("buckets", "conflict", "count", "sum")

    def __init__(self) -> None:
        self.buckets: list[tuple[float, float]] = []
        self.sum: float | None = None
        self.count: float | None = None
        self.conflict = False  # a series of it came twice with different values

    def build(self) -> Histogram | None:
        if not self.buckets or self.sum is None:
            return None
        self.buckets.sort()
        if self.buckets[-1][0] != math.inf:
            return None
        count = self.count if self.count is not None else self.buckets[-1][1]
        return Histogram(buckets=tuple(self.buckets), sum=self.sum, count=count)


def parse_vllm_metrics(
    text: str, *, taken_at_s: float, wall_time_s: float, sample_limit: int | None = None
) -> tuple[EngineSample, ...]:
    """One ``EngineSample`` per ``(model_name, engine)``; empty when there is no ``vllm:`` family.

    Raises ``MetricsParseError`` on text that is not an exposition, and its
    ``SampleLimitError`` on one with more than ``sample_limit`` samples.
    """
    values: dict[EngineKey, dict[str, float]] = {}
    ranks: dict[tuple[EngineKey, str], int] = {}
    hists: dict[tuple[EngineKey, str, str], _Hist] = {}
    cache_infos: dict[str | None, Labels] = {}
    keys: dict[Labels, tuple[EngineKey, str | None]] = {}
    seen: dict[tuple[str, Labels], float] = {}
    conflicts: set[tuple[EngineKey, str]] = set()  # (engine, family) exported twice, differently
    summed: dict[tuple[EngineKey, str], list[float]] = {}  # one value per finished_reason
    for name, labels, value in scan(text, prefixes=_PREFIXES, sample_limit=sample_limit):
        if name == _WAITING_BY_REASON:
            name = _by_reason(name, labels)
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
        earlier = seen.get((name, labels))
        if earlier is None:
            seen[(name, labels)] = value
        if part == "value":
            if earlier is not None:  # a repeated series adds nothing; a different value taints
                if not same_reading(earlier, value):
                    conflicts.add((key, family))
                continue
            rank = _PRIORITY[family]
            if ranks.get((key, field), rank + 1) > rank:
                ranks[(key, field)] = rank
                values.setdefault(key, {})[field] = value
            continue
        if part == "summed":
            if earlier is not None:
                if not same_reading(earlier, value):
                    conflicts.add((key, family))
                continue
            values.setdefault(key, {})
            summed.setdefault((key, field), []).append(value)
            continue
        if key not in values:
            values[key] = {}
        h = hists.get((key, field, family))
        if h is None:
            h = hists[(key, field, family)] = _Hist()
        if earlier is not None:
            h.conflict = h.conflict or not same_reading(earlier, value)
            continue
        if part == "bucket":
            if le is None:
                raise MetricsParseError(f"{name} without an le label")
            h.buckets.append((_le(le, name), value))
        elif part == "sum":
            h.sum = value
        else:
            h.count = value
    if not values:
        return _without_known_families(text, cache_infos, taken_at_s, wall_time_s, sample_limit)
    found = _Found(values, ranks, conflicts, hists, cache_infos, summed)
    return _assemble(found, taken_at_s, wall_time_s)


def _by_reason(name: str, labels: Labels) -> str:
    """A per-reason family's series under its own name, so each reason has its own field."""
    for k, v in labels:
        if k == "reason":
            return f"{name}:{v}"
    return name


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


@dataclass(frozen=True, slots=True)
class _Found:
    """What one pass over the lines gathered, per engine."""

    values: dict[EngineKey, dict[str, float]]
    ranks: dict[tuple[EngineKey, str], int]  # which family each value came from
    conflicts: set[tuple[EngineKey, str]]
    hists: dict[tuple[EngineKey, str, str], _Hist]
    cache_infos: dict[str | None, Labels]
    summed: dict[tuple[EngineKey, str], list[float]]


def _assemble(found: _Found, taken_at_s: float, wall_time_s: float) -> tuple[EngineSample, ...]:
    """Build the checked samples once every line has been read."""
    chosen: dict[tuple[EngineKey, str], tuple[int, Histogram, bool]] = {}
    for (key, family, base), parts in found.hists.items():
        h = parts.build()
        rank = _PRIORITY[base]
        if h is not None and chosen.get((key, family), (rank + 1,))[0] > rank:
            chosen[(key, family)] = (rank, h, parts.conflict)
    n_engines = len({engine for _, engine in found.values})
    out = []
    for key in sorted(found.values):
        checks = SampleChecks()
        fields: dict[str, object] = {}
        for name, value in found.values[key].items():
            family = _FAMILIES[found.ranks[(key, name)]]
            if (key, family) in found.conflicts:
                checks.refuse(name, "duplicate_series", f"{family} is exported twice, differently")
            elif name == "kv_usage_ratio":
                fields[name] = checks.ratio(name, value)
            elif name in _COUNTS:
                fields[name] = checks.count(name, value)
            else:
                fields[name] = checks.counter(name, value)
        for (k, name), (_, h, conflict) in chosen.items():
            if k != key:
                continue
            if conflict:
                checks.refuse(name, "duplicate_series", f"{name} has a series exported twice")
            else:
                fields[name] = checks.histogram(name, h)
        for (k, name), readings in found.summed.items():
            if k == key:
                fields[name] = _summed(name, readings, (key, _SUMMED_FAMILY[name]), found, checks)
        iterations = fields.get("iteration_tokens")
        if isinstance(iterations, Histogram):
            fields["iterations_total"] = iterations.count
        thrash = fields.get("request_preemptions")
        if isinstance(thrash, Histogram):
            fields["request_preemptions_sum"] = thrash.sum
            fields["request_preemptions_count"] = thrash.count
        info = found.cache_infos.get(key[1]) or found.cache_infos.get(None) or ()
        usage = fields.get("kv_usage_ratio")
        fields.update(
            _cache_fields(info, n_engines, usage if isinstance(usage, float) else None, checks)
        )
        out.append(
            EngineSample(
                model_name=key[0],
                engine=key[1],
                taken_at_s=taken_at_s,
                wall_time_s=wall_time_s,
                refused=checks.done(),
                **fields,  # type: ignore[arg-type]  # keys are EngineSample's own field names
            )
        )
    return tuple(out)


_SUMMED_FAMILY = {field: family for family, field in _SUMMED.items()}


def _summed(
    name: str,
    parts: list[float],
    conflict_key: tuple[EngineKey, str],
    found: _Found,
    checks: SampleChecks,
) -> float | None:
    """The sum of a counter's series; None when any of them is refused."""
    if conflict_key in found.conflicts:
        checks.refuse(name, "duplicate_series", f"{conflict_key[1]} is exported twice, differently")
        return None
    checked = [checks.counter(name, value) for value in parts]
    return None if any(c is None for c in checked) else sum(c for c in checked if c is not None)


class _CacheFields(TypedDict):
    cache_config: Labels
    num_gpu_blocks: int | None
    blocks_total: int | None
    blocks_free: int | None
    block_size: int | None


def _cache_fields(
    info: Labels, n_engines: int, usage: float | None, checks: SampleChecks
) -> _CacheFields:
    """Block figures from ``vllm:cache_config_info``'s labels and the (checked) usage ratio."""
    labels = dict(info)
    num_gpu_blocks = _int_label(labels.get("num_gpu_blocks"), "num_gpu_blocks", checks, 0)
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
        "block_size": _int_label(labels.get("block_size"), "block_size", checks, 1),
    }


# The largest integer a label may carry: every int up to it is exact as a float, so the block
# arithmetic (and prometheus_client's printing of it) cannot overflow. No pool comes close.
MAX_LABEL_INT = 2**53


def _int_label(text: str | None, field: str, checks: SampleChecks, least: int) -> int | None:
    """An integer label value in `least`..``MAX_LABEL_INT``; None for absent, "None" and
    anything else that is no integer (a number out of range is refused with its reason)."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:  # also past Python's 4,300-digit limit on int()
        return None
    if not least <= value <= MAX_LABEL_INT:
        shown = str(value) if len(text) <= 20 else f"{text[:12]}... ({len(text)} characters)"
        checks.refuse(field, "out_of_range", f"cache_config_info's {field} is {shown}")
        return None
    return value


def _without_known_families(
    text: str,
    cache_infos: dict[str | None, Labels],
    taken_at_s: float,
    wall_time_s: float,
    sample_limit: int | None,
) -> tuple[EngineSample, ...]:
    """The slow path when no family kvpilot reads was found: validate, then look for any engine."""
    engines: set[EngineKey] = set()
    for name, labels, _ in scan(text, sample_limit=sample_limit):  # garbage raises here
        if name.startswith("vllm:") and name != _CACHE_CONFIG:
            engines.add(_identity(labels)[0])
    if not engines:
        engines = {("", engine or "0") for engine in cache_infos}
    n = len({e for _, e in engines})
    out = []
    for model, engine in sorted(engines):
        checks = SampleChecks()
        info = cache_infos.get(engine) or cache_infos.get(None) or ()
        fields = _cache_fields(info, n, None, checks)
        out.append(
            EngineSample(
                model_name=model,
                engine=engine,
                taken_at_s=taken_at_s,
                wall_time_s=wall_time_s,
                refused=checks.done(),
                **fields,
            )
        )
    return tuple(out)
