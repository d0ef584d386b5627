"""Workloads for a trial: synthetic distributions (`Workload`) or a trace file, replayed.

A trace file is CSV (with a header) or JSON Lines, one request per row: arrival time in
seconds, prompt length and output length in tokens. Accepted column names:
`arrival_s` (or `timestamp_s`, `timestamp`, `arrival_time`), `prompt_tokens` (or
`prompt_len`, `input_len`, `input_tokens`), `output_tokens` (or `output_len`, `max_tokens`).
Arrivals are sorted and shifted so the first request arrives at 0. Prompts are token ids
drawn from a seed, so baseline and canary receive exactly the same traffic.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.tuner.load.generator import (
    LoadReport,
    PlannedRequest,
    Workload,
    plan_requests,
    run_planned,
)
from kvpilot.tuner.problem.fingerprint import digest

_ARRIVAL = ("arrival_s", "timestamp_s", "timestamp", "arrival_time")
_PROMPT = ("prompt_tokens", "prompt_len", "input_len", "input_tokens")
_OUTPUT = ("output_tokens", "output_len", "max_tokens")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and the row."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in arrival order, the first at 0 s."""

    requests: tuple[TraceRequest, ...]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0


def load_trace(path: str | Path) -> Trace:
    """Read a CSV or JSONL trace (by suffix: .jsonl/.json is JSON Lines, else CSV)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: {exc}") from exc
    if path.suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(text, path)
    else:
        rows = enumerate(csv.DictReader(line for line in text.splitlines() if line.strip()), 2)
    requests = [_request(row, path, number) for number, row in rows]
    if not requests:
        raise TraceError(f"{path}: no requests")
    requests.sort(key=lambda r: r.arrival_s)
    first = requests[0].arrival_s
    return Trace(tuple(dataclasses.replace(r, arrival_s=r.arrival_s - first) for r in requests))


def synthetic_trace(workload: Workload) -> Trace:
    """The trace an open-loop workload would send (closed-loop arrivals are all 0)."""
    return Trace(
        tuple(TraceRequest(p.delay_s, len(p.prompt), p.max_tokens) for p in plan_requests(workload))
    )


def plan_trace(
    trace: Trace,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    speedup: float = 1.0,
    max_model_len: int | None = None,
) -> list[PlannedRequest]:
    """The trace as requests for the load generator; `speedup` > 1 compresses time.

    With `max_model_len`, prompts are cut to leave room for one output token and outputs to
    fit the rest, so no request is rejected for its length.
    """
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    rng = random.Random(seed)
    planned = []
    for index, req in enumerate(trace.requests):
        prompt_len, output_len = max(1, req.prompt_tokens), max(1, req.output_tokens)
        if max_model_len is not None:
            prompt_len = min(prompt_len, max_model_len - 1)
            output_len = min(output_len, max_model_len - prompt_len)
        prompt = tuple(rng.randrange(3, vocab_size) for _ in range(prompt_len))
        planned.append(PlannedRequest(index, prompt, output_len, req.arrival_s / speedup))
    return planned


async def replay(
    base_url: str,
    source: Workload | Trace,
    *,
    seed: int = 0,
    speedup: float = 1.0,
    max_model_len: int | None = None,
    model: str = "tiny-llama",
    api_key: str | None = None,
    request_timeout_s: float = 300.0,
    clock: Callable[[], float] | None = None,
) -> LoadReport:
    """Send a workload or a trace to one instance and return the client-side report."""
    send_clock = clock or time.monotonic
    if isinstance(source, Workload):
        planned = plan_requests(source)
        return await run_planned(
            base_url,
            planned,
            concurrency=source.concurrency,
            request_timeout_s=source.request_timeout_s,
            model=model,
            api_key=api_key,
            clock=send_clock,
        )
    planned = plan_trace(source, seed=seed, speedup=speedup, max_model_len=max_model_len)
    return await run_planned(
        base_url,
        planned,
        request_timeout_s=request_timeout_s,
        model=model,
        api_key=api_key,
        clock=send_clock,
    )


def workload_hash(source: Workload | Trace) -> str:
    """A stable hash of the traffic, for the study's fingerprint."""
    if isinstance(source, Workload):
        return digest({"workload": dataclasses.asdict(source)})
    return digest({"trace": [dataclasses.astuple(r) for r in source.requests]})


def _jsonl_rows(text: str, path: Path) -> Iterable[tuple[int, Mapping[str, object]]]:
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise TraceError(f"{path}:{number}: expected an object")
        yield number, row


def _request(row: Mapping[str, object], path: Path, number: int) -> TraceRequest:
    # A JSON value goes to the converter as it is: what it cannot read raises, reported below.
    def pick(names: tuple[str, ...], cast: Callable[[Any], float | int]) -> float | int:
        for name in names:
            if name in row and row[name] not in (None, ""):
                try:
                    value = cast(row[name])
                except (TypeError, ValueError) as exc:
                    raise TraceError(f"{path}:{number}: {name}={row[name]!r} ({exc})") from exc
                if value < 0:
                    raise TraceError(f"{path}:{number}: {name} is negative")
                return value
        raise TraceError(f"{path}:{number}: missing {names[0]} (or {', '.join(names[1:])})")

    return TraceRequest(
        float(pick(_ARRIVAL, float)),
        int(pick(_PROMPT, _as_int)),
        int(pick(_OUTPUT, _as_int)),
    )


def _as_int(value: Any) -> int:
    number = float(value)
    if number != int(number):
        raise ValueError("not a whole number of tokens")
    return int(number)
