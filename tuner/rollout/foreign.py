"""Requests a side finished in a window that the load generator did not send: users' own
traffic on the serving instance. A side that carries them is slower for reasons the other
side does not share, so a window where they pass a share is left out of the judgement."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ForeignRequests:
    """One side's window: requests the server finished that were not the generator's
    (`foreign`), and the generator's own (`own`)."""

    foreign: int
    own: int

    @property
    def share(self) -> float:
        total = self.foreign + self.own
        return self.foreign / total if total else 0.0


class ForeignTraffic(RuntimeError):
    """Too many windows carried foreign requests for the run to be judged."""


def foreign_reason(
    sides: Sequence[tuple[str, ForeignRequests | None]], max_share: float
) -> str | None:
    """Why a window (every side of it, by URL) is left out of the judgement: a side whose
    foreign requests pass `max_share` of what it finished; None keeps it. A side that could
    not be counted (None) is kept: nothing says it carried more."""
    for url, counted in sides:
        if counted is not None and counted.share > max_share:
            return (
                f"{url} finished {counted.foreign} requests the load generator did not send "
                f"({counted.share:.1%} > {max_share:.1%})"
            )
    return None
