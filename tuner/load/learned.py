"""A workload learned from the server's own ``/metrics``, and its coarse key.

The shape is what vLLM counted over a window: the prompt and generation length histograms
(``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``, as increases over the
window), the finished requests and their rate, and the prefix cache's hit ratio.

How it is replayed (``learned_workload``):

- lengths: a histogram bucket by its share of the window's requests, then a length uniform
  inside it (vLLM's buckets run 1, 2, 5, 10, 20, 50, ...). The +Inf bucket cannot be drawn
  from; its requests are given the highest finite bound.
- arrivals: Poisson at the observed rate; a burst factor b > 1 sends them in bursts of a
  geometric size with mean b at rate / b, so the mean rate holds and the gaps grow.
- prefix reuse: vLLM's hit ratio is the share of prompt tokens found in the prefix cache.
  Each prompt opens with the first ``hit ratio`` of its length, cut down to whole KV blocks,
  of one of a pool of eight shared prefixes (chosen uniformly); the rest is random. Once a
  prefix has been sent, later prompts hit on those blocks, so the replay's hit ratio comes
  close to the observed one (a little below it: the first use of each prefix misses).

``coarse_key`` keeps only what should start a new study: for the median and the 90th
percentile of both lengths, the histogram bucket that holds it (vLLM's bounds, 1-2-5 per
decade), named by the nearest power of two of its upper bound; and the rate's bucket, each
1.25 times as wide as the last (at a fixed offered load a configuration's goodput follows
the rate, so studies at 1 and 9.9 requests a second must not share their trials). Drift
within those buckets keeps the key; lengths that move by a bucket (about twice or half) or
a rate that moves by a quarter move it. A value that sits on a bucket's edge can flip with
little change: such is any bucketing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.collectors.histogram import Histogram, quantile
from kvpilot.tuner.load.generator import BucketLengths, ShapedWorkload

PREFIX_POOL = 8
DEFAULT_BLOCK = 16  # vLLM's default --block-size, where the server did not say


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """What the server served over one window (histograms are increases over the window)."""

    prompt_tokens: Histogram
    generation_tokens: Histogram
    rate_rps: float
    prefix_hit_ratio: float | None  # None: prefix caching off, or nothing queried
    requests: int
    window_s: float
    block_size: int | None = None
    # The KV blocks a running request held, as the server's gauges measured it (blocks in
    # use over requests running, sampled each scrape); None where the window did not sample.
    kv_blocks_per_running: float | None = None

    def quantiles(self) -> dict[str, float | None]:
        """Median and 90th percentile of both lengths, for people."""
        return {
            "prompt_p50": quantile(0.5, self.prompt_tokens),
            "prompt_p90": quantile(0.9, self.prompt_tokens),
            "generation_p50": quantile(0.5, self.generation_tokens),
            "generation_p90": quantile(0.9, self.generation_tokens),
        }


def bucket_lengths(h: Histogram) -> BucketLengths | None:
    """Lengths drawn as the histogram's buckets hold them; None when it holds nothing."""
    out: list[tuple[int, int, float]] = []
    previous_le, previous_count = 0.0, 0.0
    top = 1
    for le, cumulative in h.buckets:
        weight = max(0.0, cumulative - previous_count)
        if math.isinf(le):
            if weight > 0:  # above every finite bound: the highest one stands for them
                out.append((top, top, weight))
        else:
            lowest = max(1, math.floor(previous_le) + 1)
            highest = max(lowest, math.floor(le))
            top = highest
            if weight > 0:
                out.append((lowest, highest, weight))
            previous_le = le
        previous_count = max(previous_count, cumulative)
    if not out:
        return None
    return BucketLengths(low=out[0][0], buckets=tuple(out))


def learned_workload(
    shape: WorkloadShape,
    *,
    requests: int,
    burst_factor: float = 1.0,
    seed: int = 0,
    max_model_len: int | None = None,
    headroom: float = 1.0,
) -> ShapedWorkload:
    """The shape as a replayable workload of `requests` requests, its arrivals `headroom`
    times the observed rate (a configuration must hold the SLO with room above the traffic
    seen, not only at it).

    Raises ValueError when the shape cannot be replayed (no lengths, no rate)."""
    prompt = bucket_lengths(shape.prompt_tokens)
    output = bucket_lengths(shape.generation_tokens)
    if prompt is None or output is None:
        raise ValueError("the window holds no request lengths")
    if not shape.rate_rps > 0 or math.isinf(shape.rate_rps):
        raise ValueError(f"the window's request rate {shape.rate_rps} is not a positive rate")
    return ShapedWorkload(
        num_requests=requests,
        prompt_len=prompt,
        output_len=output,
        rate_rps=shape.rate_rps * headroom,
        seed=seed,
        burst_factor=burst_factor,
        prefix_ratio=shape.prefix_hit_ratio or 0.0,
        prefix_pool=PREFIX_POOL,
        prefix_block=shape.block_size or DEFAULT_BLOCK,
        max_model_len=max_model_len,
    )


def coarse_key(shape: WorkloadShape) -> str:
    """The shape's coarse identity, e.g. ``prompt 512/512 gen 64/128 rate 1-1.25``."""
    lengths = [
        _power_of_two(_bucket_bound(q, h))
        for h in (shape.prompt_tokens, shape.generation_tokens)
        for q in (0.5, 0.9)
    ]
    return (
        f"prompt {lengths[0]}/{lengths[1]} gen {lengths[2]}/{lengths[3]} "
        f"rate {rate_bucket(shape.rate_rps)}"
    )


def _bucket_bound(q: float, h: Histogram) -> float | None:
    """The upper bound of the bucket that holds the q-quantile (no interpolation inside it:
    moving within a bucket is drift). The +Inf bucket gives the highest finite bound."""
    if h.count <= 0:
        return None
    finite = [le for le, _ in h.buckets if not math.isinf(le)]
    for le, cumulative in h.buckets:
        if cumulative >= q * h.count:
            return le if not math.isinf(le) else (finite[-1] if finite else None)
    return None


def _power_of_two(value: float | None) -> str:
    """The nearest power of two (on a log scale); '-' for no value."""
    if value is None or not value > 0 or math.isinf(value):
        return "-"
    return str(2 ** max(0, round(math.log2(value))))


RATE_BUCKET_WIDTH = 1.25


def rate_bucket(rate: float) -> str:
    """The rate's bucket, named by its bounds: buckets 1.25 times as wide as the last, one
    of them starting at 1 request a second ("1-1.25", "1.25-1.56", "0.8-1")."""
    if not rate > 0 or math.isinf(rate):
        return "0"
    # The small nudge keeps a rate on a bound (1.25 itself) out of the bucket below it.
    k = math.floor(math.log(rate) / math.log(RATE_BUCKET_WIDTH) + 1e-9)
    return f"{RATE_BUCKET_WIDTH**k:.3g}-{RATE_BUCKET_WIDTH ** (k + 1):.3g}"
