"""vLLM's own reason for a failed start, read from its start-up log.

The engine-core process raises the real error and the API server then reports only
"Engine core initialization failed. See root cause above.", so the root cause is searched
for first and the generic line is the last resort.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class StartupFailureKind(StrEnum):
    """Why vLLM refused to start, in the tuner's terms."""

    MEMORY_IN_USE = "memory_in_use"  # other processes hold what the utilisation asks for
    NO_CACHE_MEMORY = "no_cache_memory"  # nothing left for KV blocks
    CACHE_TOO_SMALL = "cache_too_small"  # not one request of max_model_len fits
    OUT_OF_MEMORY = "out_of_memory"  # the allocator failed during profiling or warm-up
    INVALID_FLAGS = "invalid_flags"  # the configuration was rejected before loading
    ENGINE_INIT = "engine_init"  # only the generic "initialization failed" line was found
    UNKNOWN = "unknown"  # no known line in the log


@dataclass(frozen=True, slots=True)
class StartupFailure:
    """One failed start: the kind, a short message, and the log line it came from."""

    kind: StartupFailureKind
    message: str
    log_line: str | None


# Most specific first: the first pattern that matches any line wins.
_PATTERNS: tuple[tuple[StartupFailureKind, re.Pattern[str], str], ...] = (
    (
        StartupFailureKind.MEMORY_IN_USE,
        re.compile(r"Free memory on device .* is less than desired GPU memory utilization"),
        "too much memory asked: other processes hold what --gpu-memory-utilization requests",
    ),
    (
        StartupFailureKind.CACHE_TOO_SMALL,
        re.compile(r"To serve at least one request with the model's max seq len"),
        "too little memory for one request of max_model_len",
    ),
    (
        StartupFailureKind.NO_CACHE_MEMORY,
        re.compile(r"No available memory for the cache blocks"),
        "no memory left for the KV cache blocks",
    ),
    (
        StartupFailureKind.OUT_OF_MEMORY,
        re.compile(r"(CUDA out of memory|OutOfMemoryError|Cannot allocate memory)"),
        "out of memory while starting",
    ),
    (
        StartupFailureKind.INVALID_FLAGS,
        re.compile(
            r"(must be greater than or equal to max_num_seqs|is smaller than max_model_len"
            r"|error: argument|error: unrecognized arguments|invalid choice)"
        ),
        "the flags were rejected",
    ),
    (
        StartupFailureKind.ENGINE_INIT,
        re.compile(r"Engine core initialization failed"),
        "the engine failed to initialise (no root cause in the log)",
    ),
)
_MAX_LINE_CHARS = 500


def parse_startup_failure(log_text: str) -> StartupFailure:
    """The most specific known reason in a failed start's log; UNKNOWN when none is found."""
    lines = log_text.splitlines()
    for kind, pattern, summary in _PATTERNS:
        for line in lines:
            if pattern.search(line):
                return StartupFailure(kind, summary, _clean(line))
    return StartupFailure(StartupFailureKind.UNKNOWN, "no known start-up error in the log", None)


def _clean(line: str) -> str:
    """The line without vLLM's logger prefix, cut to a readable length."""
    text = line.strip()
    for marker in ("ValueError: ", "RuntimeError: ", "Error: "):
        if marker in text:
            text = text[text.index(marker) :]
            break
    return text[:_MAX_LINE_CHARS]
