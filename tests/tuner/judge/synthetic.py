"""Synthetic windows for the judge's unit tests: each window's requests share its
conditions (a window-level factor), as the recorded windows do."""

from __future__ import annotations

import random

from kvpilot.tuner.judge.evidence import Counts, Samples
from kvpilot.tuner.judge.windows import Window

REQUESTS = 64


def side(
    rng: random.Random,
    condition: float,
    *,
    ttft_scale: float = 1.0,
    slow_share: float = 0.0,
    failed: int = 0,
    goodput_scale: float = 1.0,
    preemptions: float = 0.0,
    requests: int = REQUESTS,
) -> dict[str, Samples]:
    """One side's window: `slow_share` of its requests get 10x their TTFT."""
    ttft, gaps, e2e = [], [], []
    for _ in range(requests):
        t = 0.1 * condition * ttft_scale * rng.lognormvariate(0, 0.25)
        if rng.random() < slow_share:
            t *= 10
        ttft.append(t)
        gap = 0.02 * condition * rng.lognormvariate(0, 0.15)
        gaps.append(gap)
        e2e.append(t + 63 * gap)
    errors = [1.0] * failed + [0.0] * (requests - failed)
    goodput = [1000 / condition * goodput_scale * rng.lognormvariate(0, 0.05) for _ in range(4)]
    return {
        "ttft_s": tuple(ttft),
        "inter_token_s": tuple(gaps),
        "e2e_s": tuple(e2e),
        "errors_ratio": tuple(errors),
        "preemptions_per_s": Counts(preemptions, 8.0),
        "goodput_tokens_per_s": tuple(goodput),
    }


def windows(seed: int, count: int, **canary: float) -> list[Window]:
    """`count` paired windows; the canary's side changed as `canary` says (see `side`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        condition = rng.lognormvariate(0, 0.2)
        out.append(
            Window(
                canary=side(rng, condition, **canary),  # type: ignore[arg-type]
                baseline=side(rng, condition),
            )
        )
    return out
