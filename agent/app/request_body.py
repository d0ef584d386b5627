"""Reading a control request's JSON body within limits, before anything is parsed in full.

The size is checked against `Content-Length` before reading and again while the body
streams in, so a chunked body without a length is never buffered past the limit. The
nesting depth is counted by a flat scan before `json.loads`, whose recursion would otherwise
fail deep inside on a hostile body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from kvpilot.collectors.json_body import nesting_depth


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """What one control request may send."""

    max_bytes: int = 64 * 1024
    max_depth: int = 16


class RequestRejected(Exception):
    """A request refused before it is acted on: the HTTP status and a short reason."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refused (413) as soon as it is known to be over `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise RequestRejected(400, "Content-Length is not a number")
        if int(declared) > max_bytes:
            raise RequestRejected(413, f"request body over {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise RequestRejected(413, f"request body over {max_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # the caller hung up: nothing to act on, nobody to answer
        raise RequestRejected(400, "the client left before sending the whole body") from None
    return b"".join(chunks)


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number")


def parse_json(body: bytes, max_depth: int) -> Any:
    """The JSON value in `body`: UTF-8, strict (no NaN or Infinity), at most `max_depth` deep."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestRejected(400, "request body is not UTF-8") from None
    if nesting_depth(text, max_depth) > max_depth:
        raise RequestRejected(400, f"request body nested deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise RequestRejected(400, f"request body is not JSON: {exc}") from None


async def read_json(request: Request, limits: BodyLimits) -> Any:
    """The request's JSON body within `limits`; `RequestRejected` says why not."""
    return parse_json(await read_body(request, limits.max_bytes), limits.max_depth)
