"""Fuzzing the exposition parser and the samples built from it, on arbitrary bytes and text
and on mutated real payloads (`tests/fixtures/vllm/`): only the parser's own error may come
out, and whatever does parse holds no number a rule could act on wrongly (finite, in range,
block counts that agree).

The profile is pinned (derandomized, no deadline, no example database), so a run is the
same run on every machine.
"""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.collectors.kvpool.client import samples_to_scrape
from kvpilot.collectors.promtext import MetricsParseError, parse_samples, scan
from kvpilot.collectors.vllm_metrics import EngineSample, parse_vllm_metrics

PINNED = settings(
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
PAYLOADS = [p.read_bytes() for p in sorted(FIXTURES.glob("*.prom"))]
NASTY_NUMBERS = [
    "NaN",
    "+Inf",
    "-Inf",
    "-1",
    "-0",
    "1.5",
    "1e309",
    "-1e309",
    "0x10",
    "1_0",
    "",
    "nan",
    "inf",
    "Infinity",
    "3.0 1700000000000",
    '2 # {a="b"} 1',
]
COUNT_FIELDS = (
    "requests_running",
    "requests_waiting",
    "num_gpu_blocks",
    "blocks_total",
    "blocks_free",
    "block_size",
)
COUNTER_FIELDS = (
    "preemptions_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "iterations_total",
)


# Lines of the families kvpilot reads: the "number" and "conflict" edits aim there.
READ_LINES = (
    b"vllm:kv_cache_usage_perc",
    b"vllm:num_requests_running",
    b"vllm:num_requests_waiting{",
    b"vllm:num_preemptions_total",
    b"vllm:prefix_cache_",
    b"vllm:generation_tokens_total",
    b"vllm:time_to_first_token_seconds_",
    b"vllm:iteration_tokens_total_",
    b"vllm:e2e_request_latency_seconds_",
    b"vllm:cache_config_info",
)


@st.composite
def mutated_payloads(draw: st.DrawFn) -> bytes:
    """A real payload after a few edits: flipped bytes, inserted junk, cut or repeated
    lines, a truncation, and, on the lines kvpilot reads, a value swapped for a nasty
    number or a second, conflicting copy of the series."""
    data = bytearray(draw(st.sampled_from(PAYLOADS)))
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        edit = draw(
            st.sampled_from(["flip", "insert", "cut", "repeat", "truncate", "number", "conflict"])
        )
        if edit == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif edit == "insert":
            data[at:at] = draw(st.binary(max_size=40))
        elif edit == "truncate":
            del data[at:]
        elif edit in ("cut", "repeat"):
            start = data.rfind(b"\n", 0, at) + 1
            end = data.find(b"\n", at)
            end = len(data) if end < 0 else end + 1
            if edit == "cut":
                del data[start:end]
            else:
                data[end:end] = data[start:end]
        else:
            lines = bytes(data).split(b"\n")
            read = [i for i, line in enumerate(lines) if line.startswith(READ_LINES)]
            if not read:
                continue
            i = draw(st.sampled_from(read))
            other = (
                lines[i].rsplit(b" ", 1)[0] + b" " + draw(st.sampled_from(NASTY_NUMBERS)).encode()
            )
            lines[i : i + 1] = [other] if edit == "number" else [lines[i], other]
            data = bytearray(b"\n".join(lines))
    return bytes(data)


def assert_no_impossible_value(engine: EngineSample) -> None:
    usage = engine.kv_usage_ratio
    assert usage is None or 0.0 <= usage <= 1.0, usage
    for name in COUNT_FIELDS:
        count = getattr(engine, name)
        assert count is None or (isinstance(count, int) and count >= 0), (name, count)
    for name in COUNTER_FIELDS:
        counter = getattr(engine, name)
        assert counter is None or (math.isfinite(counter) and counter >= 0), (name, counter)
    for name in ("ttft", "inter_token_latency", "e2e_latency", "queue_time", "iteration_tokens"):
        h = getattr(engine, name)
        if h is None:
            continue
        counts = [c for _, c in h.buckets]
        assert all(math.isfinite(c) and c >= 0 for c in counts), (name, h)
        assert counts == sorted(counts) and h.count == counts[-1], (name, h)
        assert math.isfinite(h.sum), (name, h)


def parse_all_ways(text: str) -> None:
    """Every entry point of the parser, with and without prefixes and a sample limit."""
    for prefixes in (None, ("vllm:",), ("kvpool_",)):
        for limit in (None, 50):
            try:
                for _ in scan(text, prefixes=prefixes, sample_limit=limit):
                    pass
            except MetricsParseError:
                pass
    try:
        engines = parse_vllm_metrics(text, taken_at_s=1.0, wall_time_s=1.0)
    except MetricsParseError:
        return
    for engine in engines:
        assert_no_impossible_value(engine)


@settings(PINNED, max_examples=400)
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_raise_only_parse_errors(data: bytes) -> None:
    parse_all_ways(data.decode("utf-8", errors="replace"))  # as a source decodes a body


@settings(PINNED, max_examples=400)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=500))
def test_arbitrary_text_raises_only_parse_errors(text: str) -> None:
    parse_all_ways(text)


@settings(PINNED, max_examples=300)
@given(mutated_payloads())
def test_mutated_real_payloads_raise_only_parse_errors(data: bytes) -> None:
    parse_all_ways(data.decode("utf-8", errors="replace"))


KVPOOL_FAMILIES = (
    "kvpool_blocks_usable",
    "kvpool_blocks_free",
    "kvpool_blocks_free_cached",
    "kvpool_blocks_empty",
    "kvpool_longest_free_run_blocks",
    "kvpool_internal_fragmentation_ratio",
    "kvpool_preemptions_total",
    "kvpool_block_size_tokens",
)
KVPOOL_COUNTS = (
    "blocks_total",
    "blocks_free",
    "blocks_free_cached",
    "blocks_empty",
    "longest_free_run_blocks",
    "preemptions_total",
    "block_size_tokens",
)
FIGURES = st.one_of(
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["NaN", "+Inf", "-Inf", "0", "1"]),
)


@st.composite
def kvpool_payloads(draw: st.DrawFn) -> str:
    """Plugin expositions with arbitrary figures, some series twice."""
    lines = []
    for engine in draw(st.lists(st.sampled_from("012"), min_size=1, max_size=3, unique=True)):
        for family in KVPOOL_FAMILIES:
            labels = f'{{engine="{engine}",model_name="m"}}'
            for figure in draw(st.lists(FIGURES, min_size=0, max_size=2)):
                lines.append(f"{family}{labels} {figure.replace('inf', 'Inf')}")
    return "\n".join(draw(st.permutations(lines))) + "\n"


@settings(PINNED, max_examples=400)
@given(kvpool_payloads())
def test_kvpool_figures_that_parse_are_never_impossible(text: str) -> None:
    try:
        samples = parse_samples(text, prefixes=("kvpool_",))
    except MetricsParseError:
        return
    scrape = samples_to_scrape(samples, taken_at_s=1.0, wall_time_s=1.0)
    for engine in scrape.engines:
        frag = engine.fragmentation
        if frag is not None and frag.ratio is not None:
            assert 0.0 <= frag.ratio <= 1.0, frag
            assert 0 <= frag.longest_free_run <= frag.free <= frag.total, frag
        ratio = engine.internal_fragmentation_ratio
        assert ratio is None or 0.0 <= ratio <= 1.0, ratio
        for name in KVPOOL_COUNTS:
            count = getattr(engine, name)
            assert count is None or (isinstance(count, int) and count >= 0), (name, count)
