"""The scrape client against real loopback servers whose bytes each test writes by hand: kept
connections, a kept connection the server closed, chunked bodies, broken and hostile answers,
and what is left after a failure (nothing: the connection is closed)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.limits import Body, ScrapeLimits
from kvpilot.collectors.scrape_client import ScrapeClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Site"], Awaitable[None]]
LIMITS = ScrapeLimits(timeout_s=2.0, body_size_limit_bytes=4096)


class Site:
    """A loopback server running `handler` for each connection; counts connections and keeps
    every request head it read."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.heads: list[bytes] = []
        self.heard = asyncio.Event()  # a request head arrived
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Site:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def read_head(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        self.heard.set()
        return head

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def ok(body: bytes, *extra: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
    return head + b"".join(extra) + b"Content-Length: %d\r\n\r\n" % len(body) + body


async def keep_answering(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, site: Site
) -> None:
    n = 0
    while True:
        await site.read_head(reader)
        n += 1
        writer.write(ok(b"answer %d\n" % n))
        await writer.drain()


T = TypeVar("T")


def run(go: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(go())


def test_gets_in_a_row_share_one_connection_and_each_reads_a_fresh_answer() -> None:
    async def go() -> tuple[list[str], int]:
        async with Site(keep_answering) as site, ScrapeClient() as client:
            got = [await client.get(site.url + "/m", source="t", limits=LIMITS) for _ in range(3)]
            return [g.text for g in got if isinstance(g, Body)], site.connections

    texts, connections = run(go)
    assert texts == ["answer 1\n", "answer 2\n", "answer 3\n"]
    assert connections == 1


def test_a_kept_connection_the_server_closed_is_replaced_without_an_error() -> None:
    async def one_answer_then_close(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, site: Site
    ) -> None:
        await site.read_head(reader)
        writer.write(ok(b"fresh\n"))  # says nothing of closing, then closes
        await writer.drain()

    async def go() -> tuple[list[Body | SourceError], int]:
        async with Site(one_answer_then_close) as site, ScrapeClient() as client:
            first = await client.get(site.url + "/m", source="t", limits=LIMITS)
            await asyncio.sleep(0)  # let the close arrive, or not: both paths must hold
            second = await client.get(site.url + "/m", source="t", limits=LIMITS)
            return [first, second], site.connections

    got, connections = run(go)
    assert [g.text for g in got if isinstance(g, Body)] == ["fresh\n", "fresh\n"], got
    assert connections == 2


def test_the_request_asks_for_an_uncompressed_body_and_carries_its_headers() -> None:
    async def go() -> bytes:
        async with Site(keep_answering) as site, ScrapeClient() as client:
            got = await client.get(
                site.url + "/metrics?x=1",
                source="t",
                limits=LIMITS,
                headers={"Authorization": "Bearer k", "Accept-Encoding": "gzip"},
            )
            assert isinstance(got, Body), got
            return site.heads[0].lower()

    head = run(go)
    assert head.startswith(b"get /metrics?x=1 http/1.1\r\n")
    assert b"accept-encoding: identity\r\n" in head and b"gzip" not in head
    assert b"authorization: bearer k\r\n" in head
    assert b"host: 127.0.0.1:" in head


def test_a_chunked_body_is_read_whole_and_its_size_is_capped() -> None:
    async def chunked(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, site: Site
    ) -> None:
        head = await site.read_head(reader)
        size = 3000 if b"/big" in head else 10
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(4):
            writer.write(b"%x\r\n" % size + b"a" * size + b"\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def go() -> tuple[Body | SourceError, Body | SourceError]:
        async with Site(chunked) as site, ScrapeClient() as client:
            small = await client.get(site.url + "/small", source="t", limits=LIMITS)
            big = await client.get(site.url + "/big", source="t", limits=LIMITS)
            return small, big

    small, big = run(go)
    assert isinstance(small, Body) and small.text == "a" * 40
    assert isinstance(big, SourceError) and big.kind == "too_large", big


def test_an_answer_cut_short_is_an_error_and_the_next_get_starts_clean() -> None:
    async def cut_then_good(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, site: Site
    ) -> None:
        await site.read_head(reader)
        if site.connections == 1:  # promise 100 bytes, send 10, hang up
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        else:
            writer.write(ok(b"whole\n"))
        await writer.drain()

    async def go() -> tuple[Body | SourceError, Body | SourceError]:
        async with Site(cut_then_good) as site, ScrapeClient() as client:
            cut = await client.get(site.url + "/m", source="t", limits=LIMITS)
            good = await client.get(site.url + "/m", source="t", limits=LIMITS)
            return cut, good

    cut, good = run(go)
    assert isinstance(cut, SourceError) and cut.kind == "error", cut
    assert isinstance(good, Body) and good.text == "whole\n"


def test_a_slow_answer_times_out_and_its_late_bytes_never_reach_the_next_get() -> None:
    release = asyncio.Event()

    async def slow_first(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, site: Site
    ) -> None:
        while True:
            await site.read_head(reader)
            if len(site.heads) == 1:
                await release.wait()
                writer.write(ok(b"late\n"))
            else:
                writer.write(ok(b"on time\n"))
            await writer.drain()

    async def go() -> tuple[Body | SourceError, Body | SourceError]:
        async with Site(slow_first) as site, ScrapeClient() as client:
            quick = ScrapeLimits(timeout_s=0.2)
            slow = await client.get(site.url + "/m", source="t", limits=quick)
            release.set()
            await asyncio.sleep(0.05)
            second = await client.get(site.url + "/m", source="t", limits=LIMITS)
            return slow, second

    slow, second = run(go)
    assert isinstance(slow, SourceError) and slow.kind == "timeout"
    assert isinstance(second, Body) and second.text == "on time\n"


def test_an_endless_header_block_is_refused_not_buffered() -> None:
    async def endless_headers(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, site: Site
    ) -> None:
        await site.read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(20_000):  # about 600 KB of headers, never ending the block
            writer.write(b"X-Padding-%d: %s\r\n" % (i, b"p" * 16))
            await writer.drain()

    async def go() -> Body | SourceError:
        async with Site(endless_headers) as site, ScrapeClient() as client:
            return await client.get(site.url + "/m", source="t", limits=LIMITS)

    got = run(go)
    assert isinstance(got, SourceError) and got.kind == "error", got


def test_an_answer_that_is_not_http_is_an_error() -> None:
    async def garbage(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, site: Site
    ) -> None:
        await site.read_head(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()

    async def go() -> Body | SourceError:
        async with Site(garbage) as site, ScrapeClient() as client:
            return await client.get(site.url + "/m", source="t", limits=LIMITS)

    got = run(go)
    assert isinstance(got, SourceError) and got.kind == "error", got


def test_a_header_that_is_not_valid_http_never_shows_its_value() -> None:
    secret = "s3cret-token"

    async def go() -> Body | SourceError:
        async with Site(keep_answering) as site, ScrapeClient() as client:
            return await client.get(
                site.url + "/m",
                source="t",
                limits=LIMITS,
                headers={"Authorization": f"Bearer {secret}\r\nX-Injected: 1"},
            )

    got = run(go)
    assert isinstance(got, SourceError) and got.kind == "error", got
    assert secret not in got.message


def test_urls_that_cannot_be_scraped_are_error_values() -> None:
    async def go() -> list[Body | SourceError]:
        async with ScrapeClient() as client:
            urls = ["http://[::1/metrics", "ftp://127.0.0.1/m", "http:///m"]
            return [await client.get(u, source="t", limits=LIMITS) for u in urls]

    for got in run(go):
        assert isinstance(got, SourceError) and got.kind == "error", got


def test_a_cancelled_get_leaves_no_connection_behind() -> None:
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, site: Site) -> None:
        await site.read_head(reader)
        await asyncio.sleep(30)

    async def go() -> int:
        async with Site(never) as site, ScrapeClient() as client:
            task = asyncio.create_task(client.get(site.url + "/m", source="t", limits=LIMITS))
            await asyncio.wait_for(site.heard.wait(), 5)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return sum(len(pool) for pool in client._idle.values())

    assert run(go) == 0
