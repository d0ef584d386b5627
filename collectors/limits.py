"""Scrape limits, as Prometheus has them: a deadline for the whole response, a body-size cap
and a sample limit; and the complete answer a read within them gives
(`collectors.scrape_client` does the reading)."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_BODY_SIZE_LIMIT_BYTES = 16 * MIB  # a vLLM /metrics body is about 60 KiB per engine
DEFAULT_SAMPLE_LIMIT = 100_000  # a vLLM exposition holds about 600 samples per engine


@dataclass(frozen=True, slots=True)
class ScrapeLimits:
    """What one read of a source may cost: seconds, bytes of body, sample lines."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    body_size_limit_bytes: int = DEFAULT_BODY_SIZE_LIMIT_BYTES
    sample_limit: int = DEFAULT_SAMPLE_LIMIT

    def __post_init__(self) -> None:
        for name in ("timeout_s", "body_size_limit_bytes", "sample_limit"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class Body:
    """A complete answer, read within the limits."""

    status_code: int
    content_type: str
    text: str
