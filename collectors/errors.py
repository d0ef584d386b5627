"""The error vocabulary every source returns instead of raising."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

ErrorKind = Literal[
    "refused",  # nothing listens at the address (or the connection could not be made)
    "timeout",  # the whole response (connect, headers, body) took longer than the deadline
    "too_large",  # the body grew past the size limit; the read stopped there
    "too_many_samples",  # the exposition holds more samples than the sample limit
    "http_status",  # the server answered with a status other than 200
    "not_metrics",  # the body is not an exposition at all (an HTML error page, an empty body)
    "parse_error",  # the body looks like an exposition but does not parse
    "stats_disabled",  # vLLM runs with --disable-log-stats: no vllm: families at all
    "unavailable",  # the source cannot exist here (no NVML driver, no plugin port)
    "error",  # anything else
]

ERROR_KINDS: frozenset[str] = frozenset(get_args(ErrorKind))


@dataclass(frozen=True, slots=True)
class SourceError:
    """Why a source gave no sample this time: which source, what kind, a readable message."""

    source: str
    kind: ErrorKind
    message: str

    def __post_init__(self) -> None:
        if self.kind not in ERROR_KINDS:
            raise ValueError(f"unknown SourceError kind {self.kind!r}")
