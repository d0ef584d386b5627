"""Reading a control request's body within limits: size while streaming, depth before parsing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvpilot.agent.app.request_body import BodyLimits, RequestRejected, parse_json, read_json
from kvpilot.collectors.json_body import nesting_depth

pytestmark = pytest.mark.anyio
LIMITS = BodyLimits(max_bytes=100, max_depth=3)

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=20,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@settings(derandomize=True, deadline=None)
@given(JSON_VALUES)
def test_nesting_depth_is_the_depth_of_the_value(value: Any) -> None:
    # Strings full of brackets, quotes and escapes are in the text and must not count.
    text = json.dumps(value)
    assert nesting_depth(text, stop_above=1000) == _depth(value)


def test_nesting_depth_stops_counting_past_the_limit() -> None:
    assert nesting_depth("[" * 1_000_000, stop_above=16) == 17


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b'{"a": [[[1]]]}', 400, "nested deeper than 3"),
        (b'{"a": NaN}', 400, "not JSON"),
        (b"\xfe\xff", 400, "not UTF-8"),
        (b"{", 400, "not JSON"),
    ],
)
def test_parse_json_refuses_with_a_status_and_a_reason(
    body: bytes, status: int, words: str
) -> None:
    with pytest.raises(RequestRejected) as caught:
        parse_json(body, max_depth=3)
    assert caught.value.status_code == status and words in caught.value.message


def test_parse_json_takes_what_is_within_the_limits() -> None:
    assert parse_json(b'{"a": [[1, "]]]]"]]}', max_depth=3) == {"a": [[1, "]]]]"]]}


async def _post(content: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    async def echo(request: Request) -> JSONResponse:
        try:
            return JSONResponse({"body": await read_json(request, LIMITS)})
        except RequestRejected as exc:
            return JSONResponse({"error": exc.message}, exc.status_code)

    app = Starlette(routes=[Route("/", echo, methods=["POST"])])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post("/", content=content, headers=headers)
    return response


async def test_a_body_over_its_declared_limit_is_refused() -> None:
    response = await _post(b"[" + b"1," * 60 + b"1]")
    assert response.status_code == 413 and "over 100 bytes" in response.json()["error"]


async def test_a_chunked_body_is_refused_once_over_the_limit_and_not_read_on() -> None:
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(1000):
            sent += 1
            yield b"[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]"

    response = await _post(chunks())
    assert response.status_code == 413
    assert sent < 10, f"{sent} chunks read"


async def test_a_body_within_the_limits_is_read_whole() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"a": '
        yield b"[1, 2]}"

    response = await _post(chunks())
    assert response.status_code == 200 and response.json() == {"body": {"a": [1, 2]}}


async def test_a_client_that_leaves_mid_body_is_refused_quietly() -> None:
    refused: list[RequestRejected] = []

    async def handler(request: Request) -> JSONResponse:
        try:
            await read_json(request, LIMITS)
        except RequestRejected as exc:
            refused.append(exc)
        return JSONResponse({}, 400)

    app = Starlette(routes=[Route("/", handler, methods=["POST"])])
    messages = iter(
        [
            {"type": "http.request", "body": b'{"a": ', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    await app(scope, receive, send)
    assert [exc.status_code for exc in refused] == [400]
    assert "left before" in refused[0].message
