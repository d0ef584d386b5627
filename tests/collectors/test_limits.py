"""The streamed read every HTTP source goes through: a deadline for the whole response, a
body-size cap, against real loopback servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.kvpool.client import KvPoolScrape, KvPoolSource
from kvpilot.collectors.limits import Body, ScrapeLimits
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.collectors.vllm_metrics import VllmMetricsSource, VllmScrape
from tests.faults.misbehaving import (
    Misbehaving,
    Writer,
    answer,
    drip,
    endless,
    free_port,
    late,
)

MIB = 1 << 20
KVPOOL = b'kvpool_blocks_free{engine="0",model_name="m"} 5\n'


def fetch(url: str, limits: ScrapeLimits) -> Body | SourceError:
    async def go() -> Body | SourceError:
        async with ScrapeClient() as client:
            return await client.get(url, source="test", limits=limits)

    return asyncio.run(go())


def declares(length: int) -> Writer:
    """Headers that promise `length` bytes, then a slow trickle."""

    def write(handler, server) -> None:  # type: ignore[no-untyped-def]
        handler.send_response(200)
        handler.send_header("Content-Length", str(length))
        handler.end_headers()
        handler.wfile.write(b"x")
        server.closing.wait(30)

    return write


def test_a_complete_answer_within_the_limits() -> None:
    body = "ok é\n".encode()
    with Misbehaving({"/m": answer(body, "text/plain; charset=utf-8")}) as server:
        got = fetch(f"{server.url}/m", ScrapeLimits(timeout_s=5))
    assert got == Body(200, "text/plain; charset=utf-8", "ok é\n")


def test_a_dripping_body_times_out_at_the_deadline_not_per_read() -> None:
    with Misbehaving({"/m": drip(every_s=0.05)}) as server:
        started = time.monotonic()
        got = fetch(f"{server.url}/m", ScrapeLimits(timeout_s=0.5))
        took = time.monotonic() - started
    assert isinstance(got, SourceError) and got.kind == "timeout", got
    assert "0.5 s" in got.message and "body" in got.message
    assert 0.4 < took < 3.0  # each read came quickly; the whole answer never did


def test_a_body_past_the_cap_stops_the_read() -> None:
    total = 64 * MIB
    with Misbehaving({"/m": endless(total, b"x" * 65536)}) as server:
        got = fetch(f"{server.url}/m", ScrapeLimits(timeout_s=10, body_size_limit_bytes=MIB))
        deadline = time.monotonic() + 10
        while not server.written["/m"] and time.monotonic() < deadline:
            time.sleep(0.02)  # the server notices the hang-up at its next write
    assert isinstance(got, SourceError) and got.kind == "too_large", got
    assert f"{MIB} byte limit" in got.message
    assert server.written["/m"] and server.written["/m"][0] < total // 4


def test_a_declared_length_past_the_cap_is_refused_before_reading() -> None:
    with Misbehaving({"/m": declares(10**9)}) as server:
        started = time.monotonic()
        got = fetch(f"{server.url}/m", ScrapeLimits(timeout_s=5, body_size_limit_bytes=MIB))
        took = time.monotonic() - started
    assert isinstance(got, SourceError) and got.kind == "too_large", got
    assert "declares 1000000000 bytes" in got.message
    assert took < 4  # not the deadline: nothing of the body was waited for


def test_a_refused_connection_is_a_value() -> None:
    got = fetch(f"http://127.0.0.1:{free_port()}/m", ScrapeLimits(timeout_s=2))
    assert isinstance(got, SourceError) and got.kind == "refused"


@pytest.mark.parametrize("field", ["timeout_s", "body_size_limit_bytes", "sample_limit"])
def test_limits_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ScrapeLimits(**{field: 0})  # type: ignore[arg-type]


# -- the sources ----------------------------------------------------------------------


def vllm_scrape(base_url: str, limits: ScrapeLimits) -> VllmScrape | SourceError:
    async def go() -> VllmScrape | SourceError:
        async with ScrapeClient() as client:
            return await VllmMetricsSource(base_url, client=client, limits=limits).scrape()

    return asyncio.run(go())


def kvpool_scrape(url: str, limits: ScrapeLimits) -> KvPoolScrape | SourceError:
    async def go() -> KvPoolScrape | SourceError:
        async with ScrapeClient() as client:
            return await KvPoolSource(url, client=client, limits=limits).scrape()

    return asyncio.run(go())


PAYLOAD = b'vllm:num_requests_running{engine="0",model_name="m"} 1\n'


def test_vllm_source_kinds_past_each_limit() -> None:
    big = b"# padding\n" * 2000 + PAYLOAD
    many = PAYLOAD + b'python_gc_objects_collected_total{generation="0"} 1\n' * 50
    routes = {
        "/big/metrics": answer(big),
        "/many/metrics": answer(many),
        "/slow/metrics": drip(every_s=0.05),
    }
    limits = ScrapeLimits(timeout_s=0.5, body_size_limit_bytes=4096, sample_limit=20)
    with Misbehaving(routes) as server:
        kinds = {
            name: vllm_scrape(f"{server.url}/{name}", limits) for name in ("big", "many", "slow")
        }
    assert {name: getattr(got, "kind", got) for name, got in kinds.items()} == {
        "big": "too_large",
        "many": "too_many_samples",
        "slow": "timeout",
    }
    assert all(isinstance(got, SourceError) and got.source == "vllm" for got in kinds.values())


def test_vllm_version_read_shares_the_scrape_deadline() -> None:
    """/metrics takes 0.8 s of a 1 s deadline and /version never ends: the scrape is done at
    about 1 s (with a deadline of its own, /version would take it to 1.8 s)."""
    routes = {"/metrics": late(0.8, PAYLOAD), "/version": drip(every_s=0.05)}
    with Misbehaving(routes) as server:
        started = time.monotonic()
        got = vllm_scrape(server.url, ScrapeLimits(timeout_s=1.0))
        took = time.monotonic() - started
    assert isinstance(got, VllmScrape) and got.vllm_version is None
    assert took < 1.6


def test_kvpool_source_kinds_past_each_limit() -> None:
    routes = {
        "/big": answer(KVPOOL * 200),
        "/many": answer(KVPOOL * 30),
        "/slow": drip(every_s=0.05),
        "/ok": answer(KVPOOL),
    }
    limits = ScrapeLimits(timeout_s=0.5, body_size_limit_bytes=4096, sample_limit=20)
    with Misbehaving(routes) as server:
        got = {name: kvpool_scrape(f"{server.url}/{name}", limits) for name in routes}
    ok = got.pop("/ok")
    assert isinstance(ok, KvPoolScrape) and ok.engines[0].blocks_free == 5
    assert {name: getattr(g, "kind", g) for name, g in got.items()} == {
        "/big": "too_large",
        "/many": "too_many_samples",
        "/slow": "timeout",
    }


def test_a_request_that_cannot_be_built_is_an_error_value_each_time() -> None:
    async def go() -> list[object]:
        async with ScrapeClient() as client:
            source = KvPoolSource("http://[::1/metrics", client=client)
            return [await source.scrape() for _ in range(2)]

    for got in asyncio.run(go()):
        assert isinstance(got, SourceError) and got.kind == "error", got
