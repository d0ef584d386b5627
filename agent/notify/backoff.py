"""Exponential backoff with jitter, as the delivery worker waits between a lane's attempts."""

from __future__ import annotations

from dataclasses import dataclass

_MAX_EXPONENT = 64  # beyond this the delay is max_s anyway; avoids float overflow


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff: initial x factor^failures, capped, minus up to jitter_ratio."""

    initial_s: float = 1.0
    factor: float = 2.0
    max_s: float = 300.0
    jitter_ratio: float = 0.2

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.factor < 1 or self.max_s < self.initial_s:
            raise ValueError(f"invalid backoff {self}")
        if not 0 <= self.jitter_ratio < 1:
            raise ValueError(f"jitter_ratio must be in [0, 1), got {self.jitter_ratio}")

    def delay_s(self, failures: int, draw: float) -> float:
        """Delay after `failures` consecutive failures (0 for the first); draw is in [0, 1)."""
        exponent = min(max(failures, 0), _MAX_EXPONENT)
        base = min(self.max_s, self.initial_s * self.factor**exponent)
        return base * (1.0 - self.jitter_ratio * draw)
