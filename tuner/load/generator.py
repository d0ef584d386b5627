"""An async load generator for vLLM's OpenAI `/v1/completions`, with client-side timings.

Prompts are token ids (the rig's server runs with `--skip-tokenizer-init`), responses are
streamed so that time to first token and the gaps between tokens are measured per request.
Arrivals are open-loop (Poisson at `rate_rps`) or closed-loop (`concurrency` workers).
A `ShapedWorkload` adds bursty arrivals and prompts that open with shared prefixes (the
learned workload of `tuner.load.learned`); a plain `Workload` draws exactly as it always has.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Token lengths: fixed, uniform in [low, high], or drawn from a list of choices."""

    low: int
    high: int | None = None
    choices: tuple[int, ...] = ()

    def draw(self, rng: random.Random) -> int:
        if self.choices:
            return rng.choice(self.choices)
        if self.high is None:
            return self.low
        return rng.randint(self.low, self.high)

    @classmethod
    def fixed(cls, n: int) -> LengthDist:
        return cls(low=n)

    @classmethod
    def uniform(cls, low: int, high: int) -> LengthDist:
        return cls(low=low, high=high)


@dataclass(frozen=True, slots=True)
class BucketLengths(LengthDist):
    """Lengths drawn from histogram buckets: a bucket by its weight, then uniform inside it.

    `buckets` holds (lowest, highest, weight) with 1 <= lowest <= highest."""

    buckets: tuple[tuple[int, int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.buckets or any(lo < 1 or hi < lo or w < 0 for lo, hi, w in self.buckets):
            raise ValueError("buckets need 1 <= lowest <= highest and weights >= 0")
        if sum(w for _, _, w in self.buckets) <= 0:
            raise ValueError("buckets need a positive weight")

    def draw(self, rng: random.Random) -> int:
        lo, hi, _ = rng.choices(self.buckets, weights=[w for _, _, w in self.buckets])[0]
        return rng.randint(lo, hi)


@dataclass(frozen=True, slots=True)
class Workload:
    """What to send: how many requests, how they arrive, and how long they are."""

    num_requests: int
    prompt_len: LengthDist
    output_len: LengthDist
    concurrency: int | None = None
    rate_rps: float | None = None
    seed: int = 0
    vocab_size: int = 1024
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate_rps is None):
            raise ValueError("give exactly one of concurrency or rate_rps")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.rate_rps is not None and self.rate_rps <= 0:
            raise ValueError("rate_rps must be positive")


@dataclass(frozen=True, slots=True)
class ShapedWorkload(Workload):
    """A workload with bursts and shared prefixes (a subclass, so that a plain `Workload`'s
    fields, and the study fingerprints hashed from them, stay as they were).

    Bursts: open-loop arrivals come in batches at `rate_rps / burst_factor`, each of a
    geometric size with mean `burst_factor`, so the mean rate holds and 1.0 is plain Poisson.
    Prefixes: each prompt opens with the first `prefix_ratio` of its length, cut down to
    whole blocks of `prefix_block` tokens, of one of `prefix_pool` shared prefixes (chosen
    uniformly); the prefix cache then hits on about that share of the prompt tokens.
    `max_model_len`: outputs are cut so that prompt and output fit it.
    """

    burst_factor: float = 1.0
    prefix_ratio: float = 0.0
    prefix_pool: int = 8
    prefix_block: int = 16
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        Workload.__post_init__(self)
        if not self.burst_factor >= 1.0 or math.isinf(self.burst_factor):
            raise ValueError("burst_factor must be 1 or more")
        if not 0.0 <= self.prefix_ratio <= 1.0:
            raise ValueError("prefix_ratio must be within 0..1")
        if self.prefix_pool < 1 or self.prefix_block < 1:
            raise ValueError("prefix_pool and prefix_block must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")


@dataclass(frozen=True, slots=True)
class TraceWorkload(Workload):
    """A trace's requests as a workload: (arrival s, prompt tokens, output tokens) each, in
    arrival order, sent at their arrival times (or closed loop, when `concurrency` is set)."""

    arrivals: tuple[tuple[float, int, int], ...] = ()

    def __post_init__(self) -> None:
        Workload.__post_init__(self)
        if not self.arrivals:
            raise ValueError("a trace workload needs requests")


W = TypeVar("W", bound=Workload)


def window_seed(seed: int, salt: int, window: str) -> int:
    """The seed of one named window of a run: the workload's seed, the run's salt and the
    window's name hashed together, so that windows of one run, and runs, draw their own."""
    digest = hashlib.sha256(f"{seed}:{salt}:{window}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def for_window(workload: W, *, salt: int, window: str) -> W:
    """The workload with the prompts of one window of a run. A server's prefix cache keeps
    what the last window sent: a window that repeats those prompts measures the cache, not
    the configuration, so every window draws its own (the same name, the same prompts)."""
    return dataclasses.replace(workload, seed=window_seed(workload.seed, salt, window))


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request as the client saw it; times are monotonic seconds."""

    index: int
    prompt_tokens: int
    output_tokens_requested: int
    start_s: float
    end_s: float
    first_token_s: float | None
    # One arrival time per output token. A busy server streams several tokens in one chunk;
    # they share the chunk's arrival time (a gap of 0), so the mean gap stays TPOT.
    token_times_s: tuple[float, ...]
    output_tokens: int
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def inter_token_s(self) -> tuple[float, ...]:
        times = self.token_times_s
        return tuple(b - a for a, b in itertools.pairwise(times))


@dataclass(frozen=True, slots=True)
class LoadReport:
    """All requests of one run, in the order they were issued."""

    started_s: float
    finished_s: float
    results: tuple[RequestResult, ...]

    @property
    def ok(self) -> tuple[RequestResult, ...]:
        return tuple(r for r in self.results if r.ok)

    @property
    def failed(self) -> tuple[RequestResult, ...]:
        return tuple(r for r in self.results if not r.ok)

    @property
    def duration_s(self) -> float:
        return self.finished_s - self.started_s

    def output_tokens_per_s(self) -> float:
        tokens = sum(r.output_tokens for r in self.ok)
        return tokens / self.duration_s if self.duration_s > 0 else 0.0

    def ttfts_s(self) -> list[float]:
        return [t for r in self.ok if (t := r.ttft_s) is not None]

    def inter_tokens_s(self) -> list[float]:
        return [gap for r in self.ok for gap in r.inter_token_s]

    def e2es_s(self) -> list[float]:
        return [r.e2e_s for r in self.ok]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation between order statistics."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request to send: its token-id prompt, output length and arrival offset."""

    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    delay_s: float  # after the run starts (open loop only)


def plan_requests(workload: Workload) -> list[PlannedRequest]:
    """Draw every request up front from the seed, so two runs send the same traffic."""
    if isinstance(workload, ShapedWorkload):
        return _plan_shaped(workload)
    if isinstance(workload, TraceWorkload):
        return _plan_trace(workload)
    rng = random.Random(workload.seed)
    planned: list[PlannedRequest] = []
    at_s = 0.0
    for index in range(workload.num_requests):
        n_prompt = max(1, workload.prompt_len.draw(rng))
        prompt = tuple(rng.randrange(3, workload.vocab_size) for _ in range(n_prompt))
        if workload.rate_rps is not None and index > 0:
            at_s += rng.expovariate(workload.rate_rps)
        planned.append(PlannedRequest(index, prompt, max(1, workload.output_len.draw(rng)), at_s))
    return planned


def _plan_shaped(workload: ShapedWorkload) -> list[PlannedRequest]:
    """`plan_requests` for a ShapedWorkload: bursty arrivals, shared block-aligned prefixes."""
    rng = random.Random(workload.seed)
    prefixes: list[list[int]] = [[] for _ in range(workload.prefix_pool)]
    planned: list[PlannedRequest] = []
    at_s, left_in_burst = 0.0, 0
    block = workload.prefix_block
    for index in range(workload.num_requests):
        n_prompt = max(1, workload.prompt_len.draw(rng))
        if workload.max_model_len is not None:
            n_prompt = min(n_prompt, workload.max_model_len - 1)
        shared = int(workload.prefix_ratio * n_prompt) // block * block
        prefix = prefixes[rng.randrange(workload.prefix_pool)]
        while len(prefix) < shared:  # each prefix grows as longer prompts need it
            prefix.append(rng.randrange(3, workload.vocab_size))
        rest = tuple(rng.randrange(3, workload.vocab_size) for _ in range(n_prompt - shared))
        n_output = max(1, workload.output_len.draw(rng))
        if workload.max_model_len is not None:
            n_output = min(n_output, workload.max_model_len - n_prompt)
        if workload.rate_rps is not None:
            if left_in_burst == 0:  # a new burst: after a gap, unless it is the first
                if index > 0:
                    at_s += rng.expovariate(workload.rate_rps / workload.burst_factor)
                left_in_burst = _burst_size(rng, workload.burst_factor)
            left_in_burst -= 1
        planned.append(PlannedRequest(index, (*prefix[:shared], *rest), n_output, at_s))
    return planned


def _plan_trace(workload: TraceWorkload) -> list[PlannedRequest]:
    """`plan_requests` for a TraceWorkload: its first `num_requests` requests, as recorded."""
    rng = random.Random(workload.seed)
    planned = []
    for index, (at_s, n_prompt, n_output) in enumerate(workload.arrivals[: workload.num_requests]):
        prompt = tuple(rng.randrange(3, workload.vocab_size) for _ in range(max(1, n_prompt)))
        delay = at_s if workload.rate_rps is not None else 0.0
        planned.append(PlannedRequest(index, prompt, max(1, n_output), delay))
    return planned


def _burst_size(rng: random.Random, mean: float) -> int:
    """A geometric size (1, 2, ...) with the given mean; always 1 for a mean of 1."""
    if mean <= 1.0:
        return 1
    p = 1.0 / mean
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


async def _send(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    item: PlannedRequest,
    headers: dict[str, str],
    clock: Callable[[], float],
) -> RequestResult:
    body = {
        "model": model,
        "prompt": list(item.prompt),
        "max_tokens": item.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # how many tokens each chunk carries
    }
    start = clock()
    token_times: list[float] = []
    output_tokens: int | None = None
    error: str | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                error = f"HTTP {response.status_code}: {detail}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if choices := chunk.get("choices"):
                        carried = len(choices[0].get("token_ids") or ()) or 1
                        token_times.extend([clock()] * carried)
                    if usage := chunk.get("usage"):
                        output_tokens = int(usage.get("completion_tokens", 0))
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = clock()
    if error is None and output_tokens is None:
        error = "stream ended without a usage record"
    return RequestResult(
        index=item.index,
        prompt_tokens=len(item.prompt),
        output_tokens_requested=item.max_tokens,
        start_s=start,
        end_s=end,
        first_token_s=token_times[0] if token_times else None,
        token_times_s=tuple(token_times),
        output_tokens=output_tokens or 0,
        error=error,
    )


async def run_load(
    base_url: str,
    workload: Workload,
    *,
    model: str = "tiny-llama",
    api_key: str | None = None,
    stop: asyncio.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> LoadReport:
    """Send the workload; returns when every request has finished or `stop` is set."""
    return await run_planned(
        base_url,
        plan_requests(workload),
        concurrency=workload.concurrency,
        request_timeout_s=workload.request_timeout_s,
        model=model,
        api_key=api_key,
        stop=stop,
        clock=clock,
    )


async def run_planned(
    base_url: str,
    planned: Sequence[PlannedRequest],
    *,
    concurrency: int | None = None,
    request_timeout_s: float = 300.0,
    model: str = "tiny-llama",
    api_key: str | None = None,
    stop: asyncio.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> LoadReport:
    """Send planned requests: closed loop with `concurrency` workers, else at their delays."""
    url = f"{base_url.rstrip('/')}/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stop = stop or asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    results: list[RequestResult] = []
    started = clock()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if concurrency is not None:
            queue = list(reversed(planned))

            async def worker() -> None:
                while queue and not stop.is_set():
                    results.append(await _send(client, url, model, queue.pop(), headers, clock))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:

            async def open_loop(item: PlannedRequest) -> None:
                delay = started + item.delay_s - clock()
                if delay > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), timeout=delay)
                        return  # stopped before this request was due
                    except TimeoutError:
                        pass
                if not stop.is_set():
                    results.append(await _send(client, url, model, item, headers, clock))

            await asyncio.gather(*(open_loop(item) for item in planned))
    results.sort(key=lambda r: r.index)
    return LoadReport(started_s=started, finished_s=clock(), results=tuple(results))
