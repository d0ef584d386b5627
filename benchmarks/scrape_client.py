"""CPU per `/metrics` GET: the scrape client against httpx, in the same run.

A recorded vLLM `/metrics` under load (56 KB) is served by a keep-alive HTTP/1.1 server in a
child process, so only the client's CPU is counted (``time.process_time`` of this process).
Each round times N GETs with each client, in alternating order; the table gives the median
over rounds and the ratio httpx / scrape client. The httpx side does what the agent's read did
before the scrape client: one prepared request, sent streamed, the body read chunk by chunk.
The line `scrape, gzip` is the scrape client on the same body sent gzip-compressed unasked
(a server that ignores `Accept-Encoding: identity`), inflated within the body cap.

    .venv/bin/python benchmarks/scrape_client.py [--gets 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import multiprocessing as mp
import statistics
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from kvpilot.collectors.limits import Body, ScrapeLimits
from kvpilot.collectors.scrape_client import ScrapeClient

PAYLOAD = (
    Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom"
).read_bytes()
GZIPPED = gzip.compress(PAYLOAD)


class _Recorded(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn serves vLLM

    def do_GET(self) -> None:
        body = GZIPPED if self.path.endswith(".gz") else PAYLOAD
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        if body is GZIPPED:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _serve(ports: mp.Queue) -> None:  # type: ignore[type-arg]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorded)
    ports.put(server.server_address[1])
    server.serve_forever()


async def _httpx_cpu_s(url: str, gets: int) -> float:
    async with httpx.AsyncClient() as client:
        request = client.build_request("GET", url, headers={"Accept-Encoding": "identity"})
        started = time.process_time()
        for _ in range(gets):
            response = await client.send(request, stream=True)
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
            await response.aclose()
            assert response.status_code == 200 and len(body) == len(PAYLOAD)
            body.decode("utf-8", errors="replace")
        return (time.process_time() - started) / gets


async def _scrape_client_cpu_s(url: str, gets: int) -> float:
    limits = ScrapeLimits()
    async with ScrapeClient() as client:
        started = time.process_time()
        for _ in range(gets):
            got = await client.get(url, source="bench", limits=limits)
            assert isinstance(got, Body) and len(got.text) == len(PAYLOAD.decode())
        return (time.process_time() - started) / gets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gets", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ports: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    server = mp.Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    try:
        url = f"http://127.0.0.1:{ports.get(timeout=10)}/metrics"
        runs: dict[str, list[float]] = {"httpx": [], "scrape client": [], "scrape, gzip": []}
        for round_ in range(args.rounds):
            order = list(runs)[:: 1 if round_ % 2 == 0 else -1]
            for name in order:
                if name == "httpx":
                    runs[name].append(asyncio.run(_httpx_cpu_s(url, args.gets)))
                else:
                    where = url + ".gz" if name == "scrape, gzip" else url
                    runs[name].append(asyncio.run(_scrape_client_cpu_s(where, args.gets)))
    finally:
        server.terminate()
        server.join(5)
    baseline = statistics.median(runs["httpx"])
    print(f"{len(PAYLOAD)} byte body, {args.gets} GETs x {args.rounds} rounds, CPU per GET")
    print(f"{'client':<14} {'median ms':>10} {'min ms':>8} {'ratio to httpx':>15}")
    for name, values in runs.items():
        median = statistics.median(values)
        print(
            f"{name:<14} {median * 1e3:>10.3f} {min(values) * 1e3:>8.3f} {median / baseline:>15.2f}"
        )


if __name__ == "__main__":
    main()
