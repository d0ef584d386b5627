"""Trace files, their planning, and a replay against a small streaming fake server."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from kvpilot.tuner.load.generator import LengthDist, Workload
from kvpilot.tuner.measure.traces import (
    Trace,
    TraceError,
    TraceRequest,
    load_trace,
    plan_trace,
    replay,
    synthetic_trace,
    workload_hash,
)


def test_csv_with_alternative_column_names_is_sorted_and_shifted(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("timestamp,input_len,output_len\n12.5,100,20\n10.0,50,10\n\n11,70,5\n")
    trace = load_trace(path)
    assert trace.requests == (
        TraceRequest(0.0, 50, 10),
        TraceRequest(1.0, 70, 5),
        TraceRequest(2.5, 100, 20),
    )
    assert trace.duration_s == 2.5


def test_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"arrival_s": 0.5, "prompt_tokens": 8, "output_tokens": 4},
        {"arrival_s": 0.0, "prompt_len": 9, "max_tokens": 3},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_trace(path).requests == (TraceRequest(0.0, 9, 3), TraceRequest(0.5, 8, 4))


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.csv", "arrival_s,prompt_tokens\n0,5\n", r"a.csv:2: missing output_tokens"),
        ("b.csv", "arrival_s,prompt_tokens,output_tokens\n0,5.5,1\n", "not a whole number"),
        ("c.csv", "arrival_s,prompt_tokens,output_tokens\n-1,5,1\n", "negative"),
        (
            "d.jsonl",
            '{"arrival_s": 0, "prompt_len": 1, "output_len": 1}\nnot json\n',
            r"d.jsonl:2: not JSON",
        ),
        ("e.csv", "arrival_s,prompt_tokens,output_tokens\n", "no requests"),
    ],
)
def test_bad_traces_name_the_file_and_row(tmp_path: Path, name, text, message) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_plan_is_seeded_scaled_and_fits_max_model_len() -> None:
    trace = Trace((TraceRequest(0.0, 10, 5), TraceRequest(4.0, 2000, 300)))
    planned = plan_trace(trace, seed=3, speedup=2.0, max_model_len=1024)
    assert [p.delay_s for p in planned] == [0.0, 2.0]
    assert (len(planned[1].prompt), planned[1].max_tokens) == (1023, 1)
    assert plan_trace(trace, seed=3) == plan_trace(trace, seed=3)
    assert plan_trace(trace, seed=3)[0].prompt != plan_trace(trace, seed=4)[0].prompt


def test_synthetic_trace_and_hashes() -> None:
    workload = Workload(
        num_requests=5,
        prompt_len=LengthDist.fixed(7),
        output_len=LengthDist.uniform(2, 9),
        rate_rps=4.0,
        seed=1,
    )
    trace = synthetic_trace(workload)
    assert len(trace.requests) == 5 and all(r.prompt_tokens == 7 for r in trace.requests)
    assert trace.requests[0].arrival_s == 0.0
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)
    assert workload_hash(trace) != workload_hash(workload)
    other = Trace(trace.requests[:-1])
    assert workload_hash(other) != workload_hash(trace)
    assert workload_hash(trace) == workload_hash(synthetic_trace(workload))


async def _fake_vllm(seen: list[tuple[float, dict]]) -> asyncio.Server:
    """Answers /v1/completions with one SSE chunk per token and a usage record."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        body = json.loads(await reader.readexactly(length))
        seen.append((time.monotonic(), body))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        )
        for _ in range(body["max_tokens"]):
            writer.write(b'data: {"choices": [{"text": ""}]}\n\n')
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        writer.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_replay_sends_the_trace_at_its_arrival_times() -> None:
    trace = Trace((TraceRequest(0.0, 4, 3), TraceRequest(0.3, 6, 2), TraceRequest(0.6, 5, 1)))

    async def scenario() -> tuple[list[tuple[float, dict]], object, float]:
        seen: list[tuple[float, dict]] = []
        server = await _fake_vllm(seen)
        port = server.sockets[0].getsockname()[1]
        async with server:
            started = time.monotonic()
            report = await replay(f"http://127.0.0.1:{port}", trace, seed=1)
        return seen, report, started

    seen, report, started = asyncio.run(scenario())
    assert [len(body["prompt"]) for _, body in sorted(seen, key=lambda s: s[0])] == [4, 6, 5]
    offsets = sorted(at - started for at, _ in seen)
    assert offsets[1] == pytest.approx(0.3, abs=0.15) and offsets[2] == pytest.approx(0.6, abs=0.15)
    assert [r.output_tokens for r in report.results] == [3, 2, 1]
    assert all(r.ok for r in report.results)


def test_replay_of_a_closed_loop_workload_sends_every_request() -> None:
    workload = Workload(
        num_requests=5,
        prompt_len=LengthDist.fixed(3),
        output_len=LengthDist.uniform(1, 4),
        concurrency=2,
        seed=2,
    )

    async def scenario() -> tuple[list[tuple[float, dict]], object]:
        seen: list[tuple[float, dict]] = []
        server = await _fake_vllm(seen)
        port = server.sockets[0].getsockname()[1]
        async with server:
            report = await replay(f"http://127.0.0.1:{port}", workload)
        return seen, report

    seen, report = asyncio.run(scenario())
    expected = [r.output_tokens for r in synthetic_trace(workload).requests]
    assert len(seen) == 5
    assert [r.output_tokens for r in report.results] == expected
