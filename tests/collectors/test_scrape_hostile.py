"""What a scraped server sends, against real loopback servers: compressed bodies asked for
as identity, decompression bombs, mis-declared codings, bodies in tiny chunks, a costly
charset, JSON nested past any parser's recursion, and a URL's user-info (sent as Basic auth,
never shown)."""

from __future__ import annotations

import asyncio
import base64
import gzip
import zlib
from pathlib import Path

from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.limits import Body, ScrapeLimits
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.collectors.vllm_metrics import VllmMetricsSource, VllmScrape
from tests.collectors.test_scrape_client import LIMITS, Handler, Site, ok, run

EXPOSITION = (
    Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "v0_32_idle.prom"
).read_bytes()
PLAIN = b"# TYPE up gauge\nup 1\n" * 50


def answering(answer: bytes) -> Handler:
    """A server that answers one request with `answer`, as written."""

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, site: Site
    ) -> None:
        await site.read_head(reader)
        writer.write(answer)
        await writer.drain()

    return handler


def get_once(answer: bytes, limits: ScrapeLimits = LIMITS) -> Body | SourceError:
    async def go() -> Body | SourceError:
        async with Site(answering(answer)) as site, ScrapeClient() as client:
            return await client.get(site.url + "/metrics", source="t", limits=limits)

    return run(go)


def test_a_gzip_body_sent_unasked_is_inflated() -> None:
    got = get_once(ok(gzip.compress(PLAIN), b"Content-Encoding: gzip\r\n"))
    assert isinstance(got, Body), got
    assert got.text == PLAIN.decode()


def test_a_body_inflating_to_many_slices_is_read_whole() -> None:
    big = b"vllm:num_requests_running 1\n" * 150_000  # 4.2 MB: five slices of output
    got = get_once(ok(gzip.compress(big), b"Content-Encoding: gzip\r\n"), ScrapeLimits())
    assert isinstance(got, Body) and got.text == big.decode(), got


def test_deflate_is_inflated_zlib_wrapped_or_raw() -> None:
    raw = zlib.compressobj(wbits=-15)
    raw_body = raw.compress(PLAIN) + raw.flush()
    for body in (zlib.compress(PLAIN), raw_body):
        got = get_once(ok(body, b"Content-Encoding: deflate\r\n"))
        assert isinstance(got, Body) and got.text == PLAIN.decode(), got


def test_a_decompression_bomb_stops_at_the_cap() -> None:
    bomb = gzip.compress(b"\0" * (2 << 20))  # 2 MiB of zeros in about 2 KB, under the cap
    got = get_once(ok(bomb, b"Content-Encoding: gzip\r\n"))
    assert isinstance(got, SourceError) and got.kind == "too_large", got
    assert "inflates past 4096 bytes" in got.message


def test_a_body_that_is_not_what_its_coding_says_is_a_clear_error() -> None:
    for answer, says in [
        (ok(PLAIN, b"Content-Encoding: gzip\r\n"), "is not gzip data"),
        (ok(gzip.compress(PLAIN)[:-12], b"Content-Encoding: gzip\r\n"), "ends before its end"),
        (ok(gzip.compress(PLAIN) + b"tail", b"Content-Encoding: gzip\r\n"), "bytes follow"),
        (ok(PLAIN, b"Content-Encoding: br\r\n"), "only one of gzip or deflate"),
        (ok(PLAIN, b"Content-Encoding: gzip, gzip\r\n"), "only one of gzip or deflate"),
    ]:
        got = get_once(answer)
        assert isinstance(got, SourceError) and got.kind == "error", got
        assert says in got.message, got.message


def test_a_body_in_tiny_chunks_is_refused_before_it_costs_much() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = b"1\r\na\r\n" * 20_000 + b"0\r\n\r\n"  # 20,000 events for 20 KB of body
    got = get_once(head + chunks, ScrapeLimits(timeout_s=5.0, body_size_limit_bytes=1 << 20))
    assert isinstance(got, SourceError) and got.kind == "error", got
    assert "pieces" in got.message


def test_only_charsets_an_exposition_may_be_in_are_taken_from_the_server() -> None:
    # punycode decodes in quadratic time (seconds for 200 KB) and would change the text
    body = b"abc-def\n" * 16
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=punycode\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    got = get_once(answer)
    assert isinstance(got, Body) and got.text == body.decode(), got
    latin = ok("caf\u00e9\n".encode("latin-1")).replace(b"utf-8", b"ISO-8859-1")
    got = get_once(latin)
    assert isinstance(got, Body) and got.text == "caf\u00e9\n", got


def test_user_info_is_sent_as_basic_auth_and_never_shown() -> None:
    async def go() -> tuple[Body | SourceError, bytes, SourceError | Body]:
        async with Site(answering(ok(b"up 1\n"))) as site, ScrapeClient() as client:
            port = site.url.rsplit(":", 1)[1]
            got = await client.get(
                f"http://scraper:p%40ss-w0rd@127.0.0.1:{port}/metrics", source="t", limits=LIMITS
            )
            head = site.heads[0]
        # the site is closed: the same URL is refused, and the message names it masked
        refused = await client.get(
            f"http://scraper:p%40ss-w0rd@127.0.0.1:{port}/metrics?token=t0k3n-abc",
            source="t",
            limits=LIMITS,
        )
        return got, head, refused

    got, head, refused = run(go)
    assert isinstance(got, Body), got
    expected = base64.b64encode(b"scraper:p@ss-w0rd").decode()
    assert f"authorization: basic {expected.lower()}\r\n".encode() in head.lower(), head
    assert isinstance(refused, SourceError) and refused.kind == "refused", refused
    for secret in ("p%40ss-w0rd", "p@ss-w0rd", "scraper", "t0k3n-abc"):
        assert secret not in refused.message, refused.message
    assert "***@127.0.0.1" in refused.message


def test_version_json_nested_past_recursion_leaves_the_version_unknown() -> None:
    async def metrics_then_bomb(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, site: Site
    ) -> None:
        while True:
            head = await site.read_head(reader)
            if head.startswith(b"GET /version"):
                writer.write(ok(b"[" * 60_000))
            else:
                writer.write(ok(EXPOSITION))
            await writer.drain()

    async def go() -> VllmScrape | SourceError:
        limits = ScrapeLimits(timeout_s=5.0)
        async with Site(metrics_then_bomb) as site, ScrapeClient() as client:
            source = VllmMetricsSource(site.url, client=client, limits=limits)
            return await source.scrape()

    got = run(go)  # RecursionError came out of the scrape before
    assert isinstance(got, VllmScrape), got
    assert got.engines and got.vllm_version is None
