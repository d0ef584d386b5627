"""What the informed suggester knows before its first trial: the planner's KV need, and how
KV bytes map onto the memory knob.

The need is the learned load's tokens in flight times the planner's exact KV bytes per
token, rounded up to whole blocks. Start-up profiling and the load's own spread make it an
estimate: the prior is a band of +-`error_ratio` around it, not a point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.tuner.planner import KvGeometry

DEFAULT_PRIOR_ERROR_RATIO = 0.3


@dataclass(frozen=True, slots=True)
class KvPrior:
    """The KV bytes the load needs, give or take `error_ratio`."""

    need_bytes: int
    error_ratio: float = DEFAULT_PRIOR_ERROR_RATIO

    def __post_init__(self) -> None:
        if self.need_bytes <= 0:
            raise ValueError(f"need_bytes must be positive, not {self.need_bytes}")
        if not 0 <= self.error_ratio < 1:
            raise ValueError(f"error_ratio must be in [0, 1), not {self.error_ratio}")

    @property
    def low_bytes(self) -> float:
        return self.need_bytes * (1 - self.error_ratio)

    @property
    def high_bytes(self) -> float:
        return self.need_bytes * (1 + self.error_ratio)

    @classmethod
    def from_planner(
        cls,
        geometry: KvGeometry,
        tokens_in_flight: float,
        error_ratio: float = DEFAULT_PRIOR_ERROR_RATIO,
    ) -> KvPrior:
        """The need of `tokens_in_flight` tokens in whole blocks of the planner's geometry."""
        if not tokens_in_flight > 0 or math.isinf(tokens_in_flight):
            raise ValueError(f"tokens_in_flight must be a positive number, not {tokens_in_flight}")
        blocks = math.ceil(tokens_in_flight / geometry.block_size)
        return cls(blocks * geometry.bytes_per_block, error_ratio)


def tokens_in_flight(
    rate_rps: float, latency_s: float, prompt_tokens: float, output_tokens: float
) -> float:
    """Little's law: requests in flight (rate times latency) times the KV tokens each holds
    on average (its prompt and half its output, as the output grows while it runs)."""
    if min(rate_rps, latency_s, prompt_tokens, output_tokens) < 0:
        raise ValueError("rate, latency and lengths must not be negative")
    return rate_rps * latency_s * (prompt_tokens + output_tokens / 2)


@dataclass(frozen=True, slots=True)
class MemoryAxis:
    """KV bytes as a line in the memory knob's value: bytes = per_unit * value - offset.

    `--kv-cache-memory-bytes` is the identity; `--gpu-memory-utilization` gives the device's
    bytes per unit, less what is not KV (weights, activations, graphs: the planner's budget).
    """

    bytes_per_unit: float
    offset_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_unit > 0:
            raise ValueError("bytes_per_unit must be positive")

    @classmethod
    def identity(cls) -> MemoryAxis:
        return cls(1.0, 0.0)

    @classmethod
    def for_utilization(cls, gpu_memory_bytes: int, non_kv_bytes: int) -> MemoryAxis:
        return cls(float(gpu_memory_bytes), float(non_kv_bytes))

    def kv_bytes(self, value: float) -> float:
        return self.bytes_per_unit * value - self.offset_bytes

    def value_for(self, kv_bytes: float) -> float:
        return (kv_bytes + self.offset_bytes) / self.bytes_per_unit


@dataclass(frozen=True, slots=True)
class LoadShape:
    """The replayed load as the planner sees it: the requests in flight (Little's law on the
    learned load, an estimate), the KV bytes each holds (the planner's exact bytes per token
    times its prompt and half its output) and its mean prompt, in tokens; for an open loop,
    the output tokens per second it offers (its rate times the mean output: the goodput of
    a configuration that serves all of it), else None."""

    requests_in_flight: float
    kv_bytes_per_request: float
    prompt_tokens: float
    error_ratio: float = DEFAULT_PRIOR_ERROR_RATIO  # how far the KV bytes may err
    offered_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("requests_in_flight", "kv_bytes_per_request", "prompt_tokens"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, not {value}")
        if not 0 <= self.error_ratio < 1:
            raise ValueError(f"error_ratio must be in [0, 1), not {self.error_ratio}")
        offered = self.offered_tokens_per_s
        if offered is not None and not (offered > 0 and math.isfinite(offered)):
            raise ValueError(f"offered_tokens_per_s must be a positive number, not {offered}")

    @classmethod
    def from_planner(
        cls,
        geometry: KvGeometry,
        requests_in_flight: float,
        prompt_tokens: float,
        output_tokens: float,
        rate_rps: float | None = None,
    ) -> LoadShape:
        per_request = geometry.bytes_per_token * (prompt_tokens + output_tokens / 2)
        offered = rate_rps * output_tokens if rate_rps and output_tokens > 0 else None
        return cls(requests_in_flight, per_request, prompt_tokens, offered_tokens_per_s=offered)
