"""The learned and configured workloads as JSON (the sidecar's `GET /api/v1/workload`), and
back: `kvpilot tune --sidecar-url` replays the shape a running sidecar learned."""

from __future__ import annotations

import math
from typing import Any

from kvpilot.agent.config.tuning import TuningConfig
from kvpilot.agent.tuning.workload.choice import choose_workload
from kvpilot.collectors.histogram import Histogram
from kvpilot.tuner.load.learned import WorkloadShape, coarse_key


class ShapeJsonError(ValueError):
    """A workload answer that is not one this kvpilot writes."""


def _buckets(h: Histogram) -> list[list[Any]]:
    return [["+Inf" if math.isinf(le) else le, count] for le, count in h.buckets]


def histogram_json(h: Histogram) -> dict[str, Any]:
    """A histogram as JSON (+Inf as the string "+Inf"); `histogram_from_json` reads it."""
    return {"buckets": _buckets(h), "sum": h.sum, "count": h.count}


def shape_json(shape: WorkloadShape) -> dict[str, Any]:
    """The shape with its quantiles and coarse key, for people and for `shape_from_json`."""
    return {
        "requests": shape.requests,
        "window_s": shape.window_s,
        "rate_rps": shape.rate_rps,
        "prefix_hit_ratio": shape.prefix_hit_ratio,
        "block_size": shape.block_size,
        "kv_blocks_per_running": shape.kv_blocks_per_running,
        "coarse_key": coarse_key(shape),
        "quantiles": shape.quantiles(),
        "prompt_tokens": histogram_json(shape.prompt_tokens),
        "generation_tokens": histogram_json(shape.generation_tokens),
    }


def workload_json(
    tuning: TuningConfig,
    shape: WorkloadShape | None,
    window_requests: int,
    *,
    no_shape: str = "the window holds no finished request yet",
) -> dict[str, Any]:
    """The learned shape beside the configured workload, and which one a run would use
    (`no_shape`: why there is no shape, when there is none)."""
    try:
        choice = choose_workload(tuning, shape, no_shape=no_shape)
        chosen: dict[str, Any] = {
            "source": choice.source,
            "reason": choice.reason,
            "key": choice.key,
        }
    except ValueError as exc:  # an unreadable trace file
        chosen = {"source": "trace", "reason": str(exc), "key": None}
    learn = tuning.learn
    return {
        "learned": None if shape is None else shape_json(shape),
        "window": {
            "requests": window_requests,
            "window_s": learn.window_s,
            "min_requests": learn.min_requests,
            "enabled": learn.enabled,
            "burst_factor": learn.burst_factor,
        },
        "configured": tuning.workload.model_dump(mode="json"),
        "choice": chosen,
    }


def histogram_from_json(data: Any) -> Histogram:
    """A histogram `histogram_json` wrote; ShapeJsonError (or KeyError, TypeError,
    ValueError) when it is not one."""
    buckets = []
    for le, count in data["buckets"]:
        bound = math.inf if le == "+Inf" else float(le)
        buckets.append((bound, float(count)))
    if not buckets or not math.isinf(buckets[-1][0]):
        raise ShapeJsonError("a histogram without its +Inf bucket")
    return Histogram(tuple(buckets), float(data["sum"]), float(data["count"]))


def _positive(value: float) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"kv_blocks_per_running must be a positive number, not {value}")
    return value


def shape_from_json(data: Any) -> WorkloadShape | None:
    """The `learned` part of a workload answer; None where the sidecar has learned nothing.
    ShapeJsonError when it is malformed."""
    if not isinstance(data, dict):
        raise ShapeJsonError("the answer is not a JSON object")
    learned = data.get("learned")
    if learned is None:
        return None
    try:
        ratio = learned["prefix_hit_ratio"]
        block = learned["block_size"]
        kv = learned.get("kv_blocks_per_running")  # absent from older kvpilots' answers
        return WorkloadShape(
            prompt_tokens=histogram_from_json(learned["prompt_tokens"]),
            generation_tokens=histogram_from_json(learned["generation_tokens"]),
            rate_rps=float(learned["rate_rps"]),
            prefix_hit_ratio=None if ratio is None else float(ratio),
            requests=int(learned["requests"]),
            window_s=float(learned["window_s"]),
            block_size=None if block is None else int(block),
            kv_blocks_per_running=None if kv is None else _positive(float(kv)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ShapeJsonError(f"the learned shape is malformed: {exc!r}") from None
