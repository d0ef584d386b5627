"""Where a one-shot command gets the learned workload: a running sidecar's
`GET /api/v1/workload`, or its own window over the stable server's `/metrics` for a while.

Both answer a `Learned`: the shape (None when there is none) and where it came from, or why
there is none, as a sentence for the workload choice's reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvpilot.agent.tuning.workload.as_json import shape_from_json
from kvpilot.agent.tuning.workload.window import WorkloadWindow
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.collectors.vllm_metrics import VllmMetricsSource, VllmScrape
from kvpilot.tuner.load.learned import WorkloadShape

SIDECAR_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Learned:
    """A learned shape and where it came from; `shape` None with `why` saying why not."""

    shape: WorkloadShape | None
    why: str
    requests: int = 0


async def from_sidecar(url: str, *, timeout_s: float = SIDECAR_TIMEOUT_S) -> Learned:
    """The window a running sidecar holds (its API at `url`)."""
    where = f"{url.rstrip('/')}/api/v1/workload"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(where)
        if response.status_code != 200:
            return Learned(None, f"the sidecar at {where} answered HTTP {response.status_code}")
        data = response.json()
        shape = shape_from_json(data)
    except httpx.HTTPError as exc:
        return Learned(None, f"no sidecar answered at {where} ({type(exc).__name__})")
    except ValueError as exc:  # not JSON, or not the shape this kvpilot writes
        return Learned(None, f"the sidecar at {where} sent no workload: {str(exc)[:200]}")
    window = data.get("window") if isinstance(data, dict) else None
    seen = window.get("requests") if isinstance(window, dict) else None
    if shape is None:
        count = seen if isinstance(seen, int) and seen >= 0 else 0
        return Learned(None, f"the sidecar at {where} has learned nothing yet", count)
    return Learned(shape, f"from the sidecar at {url}", shape.requests)


async def observe(
    url: str,
    seconds: float,
    *,
    window_s: float,
    api_key: str | None = None,
    interval_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
) -> Learned:
    """Scrape the server at `url` for `seconds` (every `interval_s`) into a fresh window."""
    window = WorkloadWindow(max(window_s, seconds + interval_s))
    last_error = ""
    scrapes = 0
    async with ScrapeClient() as client:
        source = VllmMetricsSource(url, client=client, api_key=api_key, clock=clock)
        end = clock() + seconds
        while True:
            got = await source.scrape()
            if isinstance(got, VllmScrape):
                window.observe(got)
                scrapes += 1
            else:
                last_error = got.message
            left = end - clock()
            if left <= 0:
                break
            await asyncio.sleep(min(interval_s, left))
    if scrapes < 2:
        detail = f": {last_error}" if last_error else ""
        return Learned(None, f"the stable server at {url} could not be observed{detail}")
    shape = window.shape()
    if shape is None:
        return Learned(None, f"the stable server finished no request in {seconds:g} s observed")
    return Learned(shape, f"observed at {url} for {seconds:g} s", shape.requests)
