"""The HTTP client every scrape goes through: GETs over kept-alive HTTP/1.1 connections, read
within `ScrapeLimits`, never raising.

A tick scrapes each server once a second, so the client's own cost is paid all the time:
httpx spent about 1.6 ms of CPU on one 56 KB `/metrics` GET, three times what the same GET
costs here (`benchmarks/scrape_client.py`). The protocol is h11's (the parser httpx itself
uses); what is kept here is a thin transport: asyncio streams, one pool of idle connections
per origin, the request line and headers built once per URL.

- The deadline covers connecting, the headers and every byte of the body, so a server that
  drips its body a byte at a time cannot hold a tick past it.
- The body is read as it arrives and the read stops as soon as it passes the cap; a declared
  length past the cap is refused before any of the body is read. Bodies are asked for
  uncompressed (``Accept-Encoding: identity``); a server that compresses all the same has its
  gzip or deflate undone within the same cap (`collectors.content_coding`).
- What a hostile server sends costs bounded CPU: the head is capped, a body in tiny chunks is
  refused once its pieces prove too small to be worth their parsing, and a charset is taken
  only from the few an exposition can be in (some codecs, punycode, cost seconds on 200 KB).
- A URL's user-info is sent as Basic auth (an explicit Authorization header wins) and never
  shown: every message names the URL with its secrets masked.
- A connection is put back for the next GET only after a complete exchange both sides agreed
  to keep alive; any failure, timeout or cancellation closes it. A kept connection the server
  closed while idle is replaced once, transparently, when it fails before any answer.
- Scrapes connect directly: proxy variables in the environment are not read (Prometheus
  does not read them either), and redirects are not followed.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import h11

from kvpilot.collectors.content_coding import EncodingError, InflatedTooLarge, inflater_for
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.limits import Body, ScrapeLimits
from kvpilot.collectors.secrets import mask_url

READ_SIZE = 256 * 1024
# The largest status line and headers accepted: a server cannot make the client buffer
# without end before a body starts (the figure httpcore gives h11).
MAX_HEAD_BYTES = 100 * 1024
IDLE_PER_ORIGIN = 4  # a source scrapes once a tick; more than one idle is a rare overlap
USER_AGENT = "kvpilot"
# A body in pieces (chunks or reads) this small on average, past this many pieces, is refused:
# h11 spends about 6 us on each piece, so 1-byte chunks would cost a second per 170 KB.
MANY_PIECES = 4096
MIN_AVERAGE_PIECE_BYTES = 64
# Charsets an exposition may declare; any other is read as UTF-8, the format's own.
_CHARSETS = {
    "utf-8": "utf-8",
    "utf8": "utf-8",
    "us-ascii": "ascii",
    "ascii": "ascii",
    "iso-8859-1": "latin-1",
    "latin-1": "latin-1",
    "latin1": "latin-1",
}


class _Refused(Exception):
    """The connection could not be made (refused, unreachable, no such host)."""


class _TooLarge(Exception):
    def __init__(self, seen: str) -> None:
        super().__init__(seen)
        self.seen = seen


@dataclass(frozen=True, slots=True)
class _Target:
    """Where one URL's GET goes, and its request as h11 events, built once."""

    origin: tuple[str, str, int]  # scheme, host, port
    request: h11.Request


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.used = False  # an answer was read on it before: a reuse, not a fresh connection

    def reusable(self) -> bool:
        """Both sides finished and agreed to keep alive, nothing extra arrived."""
        return (
            self.http.our_state is h11.DONE
            and self.http.their_state is h11.DONE
            and not self.http.trailing_data[0]
            and not self.reader.at_eof()
        )

    def close(self) -> None:
        # abort, not close: no waiting on a peer that may be the reason we are closing
        self.writer.transport.abort()


class ScrapeClient:
    """GETs within limits, one pool of idle connections per origin; see the module's text.
    `ssl_context` verifies HTTPS servers (the system's default when None)."""

    def __init__(self, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl_context = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._targets: dict[tuple[str, tuple[tuple[str, str], ...]], _Target] = {}

    async def get(
        self,
        url: str,
        *,
        source: str,
        limits: ScrapeLimits,
        headers: Mapping[str, str] | None = None,
    ) -> Body | SourceError:
        """GET `url` within `limits` (the deadline and the body cap); never raises but on
        cancellation."""
        deadline = limits.timeout_s
        shown = mask_url(url)  # what messages say: the URL without its secrets
        try:
            target = self._target(url, headers)
            async with asyncio.timeout(deadline):  # the whole exchange, not each read
                return await self._exchange(target, limits.body_size_limit_bytes)
        except TimeoutError:
            return SourceError(
                source,
                "timeout",
                f"{shown}: no complete answer within {deadline:g} s (the whole "
                "response: connection, headers and body)",
            )
        except (_TooLarge, InflatedTooLarge) as e:
            return SourceError(
                source,
                "too_large",
                f"{shown}: the body is larger than the {limits.body_size_limit_bytes} byte "
                f"limit ({e.seen})",
            )
        except EncodingError as e:
            return SourceError(source, "error", f"{shown}: {e}")
        except _Refused as e:
            return SourceError(source, "refused", f"cannot connect to {shown}: {e}")
        except (h11.ProtocolError, OSError, ValueError, EOFError) as e:
            return SourceError(source, "error", f"{shown}: {type(e).__name__}: {e}")
        except Exception as e:  # a read must never take the agent down; reported, not hidden
            return SourceError(source, "error", f"{shown}: unexpected {type(e).__name__}: {e}")

    async def aclose(self) -> None:
        """Close every idle connection; the client stays usable."""
        for pool in self._idle.values():
            for connection in pool:
                connection.close()
        self._idle.clear()

    async def __aenter__(self) -> ScrapeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- one exchange -------------------------------------------------------------------

    async def _exchange(self, target: _Target, cap: int) -> Body:
        connection = await self._connection(target.origin)
        try:
            try:
                return await self._send_and_read(connection, target, cap)
            except _StaleConnection:
                connection.close()
                connection = await self._open(target.origin)
                return await self._send_and_read(connection, target, cap)
        except BaseException:
            connection.close()
            raise

    async def _send_and_read(self, connection: _Connection, target: _Target, cap: int) -> Body:
        reused = connection.used
        http = connection.http
        try:
            connection.writer.write(http.send(target.request) + http.send(h11.EndOfMessage()))
            response = await _next(connection, reused=reused)
        except (ConnectionError, h11.RemoteProtocolError) as e:
            if reused:  # the server closed the idle connection; not this GET's failure
                raise _StaleConnection from e
            raise
        while isinstance(response, h11.InformationalResponse):
            response = await _next(connection, reused=False)
        if not isinstance(response, h11.Response):
            raise h11.RemoteProtocolError(f"expected a response, got {type(response).__name__}")
        declared = _header(response, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise _TooLarge(f"it declares {int(declared)} bytes")
        encoding = _header(response, b"content-encoding")
        inflater = inflater_for(None if encoding is None else encoding.decode("latin-1"), cap)
        body = bytearray()
        sent = pieces = 0  # bytes as sent (before inflating), and the pieces they came in
        while True:
            event = await _next(connection, reused=False)
            if isinstance(event, h11.Data):
                sent += len(event.data)
                pieces += 1
                if sent > cap:  # stop here: the rest is never read
                    raise _TooLarge(f"{sent} bytes read so far")
                if pieces > MANY_PIECES and sent < pieces * MIN_AVERAGE_PIECE_BYTES:
                    raise h11.RemoteProtocolError(
                        f"the body comes in {pieces} pieces of {sent // pieces} bytes on "
                        "average; refused, as parsing so many pieces costs more than the body"
                    )
                if inflater is None:
                    body += event.data
                    continue
                body += inflater.feed(event.data)
                while inflater.more:  # the loop runs between slices: no inflate holds it long
                    await asyncio.sleep(0)
                    body += inflater.feed(b"")
            elif isinstance(event, h11.EndOfMessage):
                break
        if inflater is not None:
            body += inflater.finish()
        connection.used = True
        self._put_back(target.origin, connection)
        content_type = (_header(response, b"content-type") or b"").decode("latin-1")
        return Body(
            status_code=response.status_code,
            content_type=content_type,
            text=_decode(body, _charset(content_type)),
        )

    # -- connections --------------------------------------------------------------------

    async def _connection(self, origin: tuple[str, str, int]) -> _Connection:
        pool = self._idle.get(origin)
        while pool:
            connection = pool.pop()
            if connection.reader.at_eof():  # closed by the server while idle
                connection.close()
                continue
            return connection
        return await self._open(origin)

    async def _open(self, origin: tuple[str, str, int]) -> _Connection:
        scheme, host, port = origin
        tls = self._tls() if scheme == "https" else None
        try:
            reader, writer = await asyncio.open_connection(
                host, port, ssl=tls, server_hostname=host if tls else None, limit=READ_SIZE
            )
        except ssl.SSLError:  # an OSError too, but a refused certificate is an error
            raise
        except OSError as e:
            raise _Refused(str(e) or type(e).__name__) from e
        return _Connection(reader, writer)

    def _put_back(self, origin: tuple[str, str, int], connection: _Connection) -> None:
        pool = self._idle.setdefault(origin, [])
        if connection.reusable() and len(pool) < IDLE_PER_ORIGIN:
            connection.http.start_next_cycle()
            pool.append(connection)
        else:
            connection.close()

    def _tls(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        return self._ssl_context

    def _target(self, url: str, headers: Mapping[str, str] | None) -> _Target:
        key = (url, tuple(sorted((headers or {}).items())))
        target = self._targets.get(key)
        if target is None:
            target = _build_target(url, headers or {})
            if len(self._targets) > 1024:  # URLs come from config; bound it all the same
                self._targets.clear()
            self._targets[key] = target
        return target


class _StaleConnection(Exception):
    """A kept connection failed before any answer: the server had closed it."""


async def _next(connection: _Connection, *, reused: bool) -> object:
    """The next h11 event, reading from the socket as h11 needs."""
    http = connection.http
    while True:
        event = http.next_event()
        if event is not h11.NEED_DATA:
            return event
        data = await connection.reader.read(READ_SIZE)
        if not data and reused and http.their_state is h11.SEND_RESPONSE:
            raise _StaleConnection("closed before answering")
        http.receive_data(data)


def _build_target(url: str, headers: Mapping[str, str]) -> _Target:
    parts = urlsplit(url)  # raises ValueError on a malformed URL (an unclosed IPv6 bracket)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"only http and https URLs are scraped, not {parts.scheme!r}")
    host = parts.hostname
    if not host:
        raise ValueError("the URL names no host")
    default_port = 443 if parts.scheme == "https" else 80
    port = parts.port or default_port
    shown_host = f"[{host}]" if ":" in host else host
    authority = shown_host if port == default_port else f"{shown_host}:{port}"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    sent = {
        "Host": authority,
        "User-Agent": USER_AGENT,
        "Accept": "*/*",
        **headers,
        "Accept-Encoding": "identity",
    }
    if parts.username is not None and not any(k.lower() == "authorization" for k in headers):
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        sent["Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode("ascii")
    try:
        request = h11.Request(method="GET", target=path, headers=list(sent.items()))
    except h11.LocalProtocolError:
        # h11's message quotes the offending header, which may be the API key
        raise ValueError("a request header or the path is not valid HTTP") from None
    return _Target(origin=(parts.scheme, host, port), request=request)


def _header(response: h11.Response, name: bytes) -> bytes | None:
    for key, value in response.headers:
        if key == name:
            return value.strip()
    return None


def _charset(content_type: str) -> str | None:
    for param in content_type.split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            return value.strip().strip('"') or None
    return None


def _decode(body: bytearray, charset: str | None) -> str:
    """The body as text (an exposition is UTF-8); undecodable bytes become U+FFFD. Only a
    charset of `_CHARSETS` is taken from the server: each costs linear time."""
    codec = _CHARSETS.get((charset or "").lower(), "utf-8")
    return body.decode(codec, errors="replace")
