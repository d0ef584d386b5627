"""Which way a server's memory was wrong when it died: too big, or too small.

*Too big* (the memory knob asked for more than the machine has): CUDA's out-of-memory error,
the CPU build's "... is less than requested memory for kv ...", vLLM's "Free memory on
device ... is less than desired GPU memory utilization", a kill by the OOM killer (the
kubelet's `OOMKilled`; locally a SIGKILL while the cgroup's `oom_kill` count rose).
*Too small* (the KV cache cannot hold one request): "No available memory for the cache
blocks", "To serve at least one request ...". A too-big server is stepped down; a too-small
one never is.

The evidence is read from the exit and the log; where it says nothing about memory the
answer is `NotOom` with the reason, never a guess. Only the engine's own error lines count
(`engine_error`): the log also carries what clients sent (a logged prompt, a request's chat
template raising its own text), and a line that merely quotes an out-of-memory message must
never step a server's memory down.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
OOM_KILLED = "OOMKilled"  # the kubelet's reason for a container the OOM killer ended


class OomDirection(StrEnum):
    TOO_BIG = "too_big"  # step the memory knob down
    TOO_SMALL = "too_small"  # never down: up, within what fits


class OomSource(StrEnum):
    LOG = "log"  # vLLM's own error line
    OOM_KILLER = "oom_killer"  # SIGKILL while the cgroup's oom_kill count rose
    KUBELET = "kubelet"  # the container status's OOMKilled


@dataclass(frozen=True, slots=True)
class ExitFacts:
    """What is known of one exit. A count is None where the cgroup could not be read."""

    exit_code: int | None = None  # negative: killed by that signal (subprocess convention)
    log_text: str | None = None
    oom_kills_before: int | None = None  # the cgroup's oom_kill when the server started
    oom_kills_after: int | None = None  # ... and after it died
    container_reason: str | None = None  # the kubelet's termination reason


@dataclass(frozen=True, slots=True)
class OomVerdict:
    """A memory death: which way, from what evidence, and what the log said was short."""

    direction: OomDirection
    source: OomSource
    message: str
    log_line: str | None = None
    requested_bytes: int | None = None  # what the knob asked for, where the log says
    available_bytes: int | None = None  # what was there, where the log says

    @property
    def short_bytes(self) -> int | None:
        """How much was missing, where the log says both figures."""
        if self.requested_bytes is None or self.available_bytes is None:
            return None
        return max(0, self.requested_bytes - self.available_bytes)


@dataclass(frozen=True, slots=True)
class NotOom:
    """Not a memory death, or no evidence of one: why."""

    reason: str


_NUM = r"([0-9]+(?:\.[0-9]+)?)"
# cpu_worker.py: "Available memory on node 0 (1.5/23.5 GiB) on kv cache allocation is less
# than requested memory for kv (4096.0 GiB)." (auto-sized: "(R/T GiB)").
_CPU_KV = re.compile(
    rf"Available memory on node \S+ \({_NUM}/{_NUM} GiB\) on kv cache allocation is less "
    rf"than requested memory for kv \({_NUM}(?:/{_NUM})? GiB\)"
)
# torch: "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of
# 79.15 GiB of which 6.81 MiB is free."
_CUDA = re.compile(r"CUDA out of memory|torch\.OutOfMemoryError|CUDA error: out of memory")
_CUDA_TRIED = re.compile(rf"Tried to allocate {_NUM} (GiB|MiB|KiB|B)\b")
_CUDA_FREE = re.compile(rf"of which {_NUM} (GiB|MiB|KiB|B) is free")
_GPU_UTIL = re.compile(r"Free memory on device .* is less than desired GPU memory utilization")
_TOO_SMALL = (
    re.compile(r"No available memory for the cache blocks"),
    re.compile(r"To serve at least one request with the model's max seq len"),
)
_UNITS = {"GiB": GIB, "MiB": MIB, "KiB": 1 << 10, "B": 1}
_MAX_LINE_CHARS = 500
# vLLM prefixes what each of its processes writes with "(EngineCore_DP0 pid=7) "; a logger
# record then reads "ERROR 12-01 18:55:30 [core.py:1510] message", a traceback's stderr
# comes bare.
_ORIGIN = re.compile(
    r"(?:\((?P<process>[\w.-]+) pid=\d+\) )?"
    r"(?:(?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] )?"
    r"(?P<message>.*)"
)
# The exceptions vLLM and torch raise for memory (a template's error, say, is none of them).
_EXCEPTION = re.compile(r"(?:ValueError|RuntimeError|(?:torch\.(?:cuda\.)?)?OutOfMemoryError): ")
_ERROR_LEVELS = frozenset({"ERROR", "CRITICAL"})
# The processes that take requests ("APIServer", "ApiServer_1"): their errors may quote what a
# client sent. Memory errors are raised in the engine core and its workers, which never log a
# request's text.
_REQUEST_PROCESS = "apiserver"


def classify_exit(facts: ExitFacts) -> OomVerdict | NotOom:
    """The direction of a memory death from `facts`, or why it is not one.

    The kubelet's word first, then the cgroup's count, then the log: a killed process writes
    nothing, and a log line names the direction most precisely when there is one.
    """
    if facts.container_reason == OOM_KILLED:
        return OomVerdict(
            OomDirection.TOO_BIG, OomSource.KUBELET, "the kubelet reports the container OOMKilled"
        )
    killed = oom_killed(facts)
    if killed is not None:
        return killed
    if facts.log_text:
        found = classify_log(facts.log_text)
        if found is not None:
            return found
    if facts.exit_code == -signal.SIGKILL:
        return NotOom(_sigkill_without_count(facts))
    if not facts.log_text:
        return NotOom("no log to read and no OOM-killer evidence")
    return NotOom("no out-of-memory line in the log")


def oom_killed(facts: ExitFacts) -> OomVerdict | None:
    """The OOM killer's kill: the cgroup's oom_kill count rose while the server ran, and the
    server died by SIGKILL (or its exit code cannot be read: a process it did not start)."""
    before, after = facts.oom_kills_before, facts.oom_kills_after
    if before is None or after is None or after <= before:
        return None
    if facts.exit_code not in (None, -signal.SIGKILL, 128 + signal.SIGKILL):
        return None
    return OomVerdict(
        OomDirection.TOO_BIG,
        OomSource.OOM_KILLER,
        f"killed by the OOM killer (the cgroup's oom_kill count rose from {before} to {after})",
    )


def engine_error(line: str) -> str | None:
    """The exception (`ValueError: ...`) that `line` reports as the engine's own error, or
    None: a record below ERROR (a logged request), a line of the process that takes requests,
    or any line whose message is not an exception's."""
    origin = _ORIGIN.fullmatch(line.strip())
    if origin is None:
        return None
    process, level, message = origin.group("process", "level", "message")
    if level is not None and level not in _ERROR_LEVELS:
        return None
    if process is not None and process.lower().startswith(_REQUEST_PROCESS):
        return None
    return message if _EXCEPTION.match(message) else None


def classify_log(text: str) -> OomVerdict | None:
    """The memory error the engine's own error lines name, most specific first; None when
    they name none."""
    lines = [error for line in text.splitlines() if (error := engine_error(line)) is not None]
    for line in lines:
        match = _CPU_KV.search(line)
        if match:
            available, _total, requested = (float(match.group(i)) for i in (1, 2, 3))
            return OomVerdict(
                OomDirection.TOO_BIG,
                OomSource.LOG,
                "the KV cache asked for more memory than the node has available",
                _clean(line),
                int(requested * GIB),
                int(available * GIB),
            )
    for pattern in _TOO_SMALL:
        for line in lines:
            if pattern.search(line):
                return OomVerdict(
                    OomDirection.TOO_SMALL,
                    OomSource.LOG,
                    "the KV cache is too small for one request of max_model_len",
                    _clean(line),
                )
    for line in lines:
        if _GPU_UTIL.search(line):
            return OomVerdict(
                OomDirection.TOO_BIG,
                OomSource.LOG,
                "other processes hold what --gpu-memory-utilization asks for",
                _clean(line),
            )
    for line in lines:
        if _CUDA.search(line):
            return OomVerdict(
                OomDirection.TOO_BIG,
                OomSource.LOG,
                "CUDA ran out of memory",
                _clean(line),
                _bytes(_CUDA_TRIED.search(line)),
                _bytes(_CUDA_FREE.search(line)),
            )
    return None


def container_termination_reason(pod: Mapping[str, Any], container: str) -> str | None:
    """The kubelet's reason for the container's current or last termination (`OOMKilled`)."""
    for status in (pod.get("status") or {}).get("containerStatuses") or ():
        if status.get("name") != container:
            continue
        for where in (status.get("state") or {}, status.get("lastState") or {}):
            reason = (where.get("terminated") or {}).get("reason")
            if isinstance(reason, str):
                return reason
    return None


def _sigkill_without_count(facts: ExitFacts) -> str:
    if facts.oom_kills_before is None or facts.oom_kills_after is None:
        return "killed by SIGKILL, and the cgroup's oom_kill count cannot be read: not known"
    return "killed by SIGKILL, and the cgroup's oom_kill count did not rise: not the OOM killer"


def _bytes(match: re.Match[str] | None) -> int | None:
    return None if match is None else int(float(match.group(1)) * _UNITS[match.group(2)])


def _clean(line: str) -> str:
    text = line.strip()
    for marker in ("ValueError: ", "RuntimeError: ", "OutOfMemoryError: "):
        if marker in text:
            text = text[text.index(marker) :]
            break
    return text[:_MAX_LINE_CHARS]
