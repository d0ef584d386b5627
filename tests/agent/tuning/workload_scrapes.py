"""Synthetic `VllmScrape`s with request-length histograms and counters, for the learned
workload's tests (built as the parser builds them, from numbers the test chooses)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.collectors.histogram import Histogram
from kvpilot.collectors.vllm_parse import EngineSample, VllmScrape

# vLLM's bounds for the request token histograms (1, 2, 5 per decade).
BOUNDS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, float("inf"))


def histogram(lengths: Sequence[int]) -> Histogram:
    """The cumulative histogram of these observations over vLLM's bounds."""
    buckets = tuple((le, float(sum(1 for n in lengths if n <= le))) for le in BOUNDS)
    return Histogram(buckets, float(sum(lengths)), float(len(lengths)))


def engine(
    prompts: Sequence[int],
    outputs: Sequence[int],
    *,
    at_s: float,
    engine_id: str = "0",
    hits: float = 0.0,
    queries: float = 0.0,
    success: float | None = None,
    block_size: int | None = 16,
) -> EngineSample:
    """One engine whose cumulative counters hold these finished requests."""
    return EngineSample(
        model_name="m",
        engine=engine_id,
        taken_at_s=at_s,
        wall_time_s=at_s,
        request_prompt_tokens=histogram(prompts),
        request_generation_tokens=histogram(outputs),
        requests_success_total=float(len(prompts)) if success is None else success,
        prefix_cache_hits_total=hits,
        prefix_cache_queries_total=queries,
        block_size=block_size,
    )


def scrape(at_s: float, *engines: EngineSample) -> VllmScrape:
    return VllmScrape(taken_at_s=at_s, wall_time_s=at_s, engines=engines, vllm_version="0.32.0")


def served(
    n: int, *, at_s: float, prompt: int = 300, output: int = 60, hits: float = 0.0
) -> VllmScrape:
    """A one-engine server that has finished `n` requests of these lengths by `at_s`."""
    return scrape(
        at_s, engine([prompt] * n, [output] * n, at_s=at_s, hits=hits, queries=float(prompt * n))
    )
