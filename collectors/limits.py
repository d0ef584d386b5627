"""Scrape limits, as Prometheus has them: a deadline for the whole response, a body-size cap
and a sample limit; and the one streamed read every HTTP source goes through.

The deadline covers connecting, the headers and every byte of the body (``asyncio.timeout``
around the streamed read), so a server that drips its body a byte at a time cannot hold a
tick past it; httpx's own timeout only bounds each read. The body is streamed and the read
stops as soon as it passes the cap, so memory never holds more than the cap. Bodies are
asked for uncompressed (``Accept-Encoding: identity``): the cap then bounds what is read
and what is decoded alike, and no compressed bomb can expand past it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from kvpilot.collectors.errors import SourceError

MIB = 1 << 20
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_BODY_SIZE_LIMIT_BYTES = 16 * MIB  # a vLLM /metrics body is about 60 KiB per engine
DEFAULT_SAMPLE_LIMIT = 100_000  # a vLLM exposition holds about 600 samples per engine


@dataclass(frozen=True, slots=True)
class ScrapeLimits:
    """What one read of a source may cost: seconds, bytes of body, sample lines."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    body_size_limit_bytes: int = DEFAULT_BODY_SIZE_LIMIT_BYTES
    sample_limit: int = DEFAULT_SAMPLE_LIMIT

    def __post_init__(self) -> None:
        for name in ("timeout_s", "body_size_limit_bytes", "sample_limit"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class Body:
    """A complete answer, read within the limits."""

    status_code: int
    content_type: str
    text: str


async def fetch_text(
    client: httpx.AsyncClient,
    url: str,
    *,
    source: str,
    limits: ScrapeLimits,
    headers: Mapping[str, str] | None = None,
    prepared: PreparedGet | None = None,
) -> Body | SourceError:
    """GET `url` within `limits` (the deadline and the body cap); never raises. `prepared`,
    made with the same client, url, headers and limits, saves building the request again."""
    deadline = limits.timeout_s
    try:
        async with asyncio.timeout(deadline):  # the whole exchange, not each read
            if prepared is not None:
                request = prepared.request()
            else:
                request = _build_get(client, url, limits, headers)
            return await _read(client, request, url, source, limits)
    except (TimeoutError, httpx.TimeoutException):
        return SourceError(
            source,
            "timeout",
            f"{url}: no complete answer within {deadline:g} s (the whole "
            "response: connection, headers and body)",
        )
    except httpx.ConnectError as e:
        return SourceError(source, "refused", f"cannot connect to {url}: {e or type(e).__name__}")
    except httpx.HTTPError as e:
        return SourceError(source, "error", f"{url}: {type(e).__name__}: {e}")
    except Exception as e:  # a read must never take the agent down; reported, not hidden
        return SourceError(source, "error", f"{url}: unexpected {type(e).__name__}: {e}")


class PreparedGet:
    """The GET one source sends scrape after scrape, built at its first use and kept: parsing
    the URL and merging the headers again cost about a sixth of a loopback scrape's CPU.
    Cookies a server sets are not sent back (a scrape carries no session)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        *,
        limits: ScrapeLimits,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._client = client
        self._url = url
        self._limits = limits
        self._headers = dict(headers or {})
        self._request: httpx.Request | None = None

    def request(self) -> httpx.Request:
        """The request; building it may raise (a bad URL), and is tried again next time."""
        if self._request is None:
            self._request = _build_get(self._client, self._url, self._limits, self._headers)
        return self._request


def _build_get(
    client: httpx.AsyncClient,
    url: str,
    limits: ScrapeLimits,
    headers: Mapping[str, str] | None,
) -> httpx.Request:
    sent = {**(headers or {}), "Accept-Encoding": "identity"}
    return client.build_request("GET", url, headers=sent, timeout=limits.timeout_s)


async def _read(
    client: httpx.AsyncClient, request: httpx.Request, url: str, source: str, limits: ScrapeLimits
) -> Body | SourceError:
    cap = limits.body_size_limit_bytes
    resp = await client.send(request, stream=True)
    try:
        declared = _content_length(resp)
        if declared is not None and declared > cap:
            return _too_large(source, url, cap, f"it declares {declared} bytes")
        body = bytearray()
        async for chunk in resp.aiter_bytes():
            body += chunk
            if len(body) > cap:  # stop here: the rest is never read
                return _too_large(source, url, cap, f"{len(body)} bytes read so far")
        return Body(
            status_code=resp.status_code,
            content_type=resp.headers.get("content-type", ""),
            text=_decode(body, resp.charset_encoding),
        )
    finally:
        await resp.aclose()


def _content_length(resp: httpx.Response) -> int | None:
    try:
        return int(resp.headers["content-length"])
    except (KeyError, ValueError):
        return None


def _decode(body: bytearray, charset: str | None) -> str:
    """The body as text (an exposition is UTF-8); undecodable bytes become U+FFFD."""
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")


def _too_large(source: str, url: str, cap: int, seen: str) -> SourceError:
    return SourceError(
        source, "too_large", f"{url}: the body is larger than the {cap} byte limit ({seen})"
    )
