"""The control API, attacked over HTTP: whatever is sent, a clear 4xx JSON answer and nothing
written (no silence, no audit row, no journal change) unless the request is sound.

One real `kvpilot run --config` serves every test here; what it wrote is read back from its
SQLite file (read-only) before and after each refused request.
"""

from __future__ import annotations

import contextlib
import socket
import sqlite3
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvpilot.rig.server import free_port
from tests.agent.sidecar_harness import AgentProcess
from tests.http_helpers import ServedInThread

# Each test starts the agent as a process: the inner loop (-m "not slow") skips them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = (ROOT / "tests" / "fixtures" / "vllm" / "v0_32_under_load.prom").read_bytes()
TOKEN = "abuse-test-control-token-7f3c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INSTANCE = "vllm"
CONTROL = ("/api/v1/silences", "/api/v1/remediations", "/api/v1/vetoes")


class _RecordedVllm(BaseHTTPRequestHandler):
    """A recorded vLLM `/metrics` payload on loopback."""

    def do_GET(self) -> None:
        body = PAYLOAD if self.path == "/metrics" else b""
        self.send_response(200 if self.path in ("/metrics", "/health") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class Agent:
    """The agent under attack, and what it has written."""

    def __init__(self, process: AgentProcess, state_dir: Path) -> None:
        self.process = process
        self.url = process.url
        self.db = state_dir / "kvpilot.db"

    def post(self, path: str, token: str | None = TOKEN, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        headers.update(kwargs.pop("headers", {}))
        return httpx.post(f"{self.url}{path}", headers=headers, timeout=30, **kwargs)

    def written(self) -> dict[str, Any]:
        """Everything the control API writes: its audit rows, silences, remediation facts."""
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True) as conn:
            audit = conn.execute("SELECT * FROM audit WHERE actor = 'api' ORDER BY id").fetchall()
            silences = conn.execute("SELECT * FROM silences ORDER BY silence_id").fetchall()
            facts = conn.execute(
                "SELECT key, value_json FROM kv WHERE key LIKE 'remediation.%' ORDER BY key"
            ).fetchall()
        status = httpx.get(f"{self.url}/api/v1/status", timeout=5).json()["remediation"]
        return {
            "audit": audit,
            "silences": silences,
            # The known instance's breaker is the agent's own to save at any tick.
            "facts": [f for f in facts if f[0] != f"remediation.breaker.{INSTANCE}"],
            "vetoed": status["vetoed_instances"],
            "breakers": [b["instance"] for b in status["breakers"]],
        }


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    folder = tmp_path_factory.mktemp("api-abuse")
    with ServedInThread(_RecordedVllm) as vllm:
        port = free_port()
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "api": {"token": TOKEN},
            "interval_s": 0.5,
            "state_dir": str(folder / "state"),
            # Watched by URL: an attached server is never signalled, whatever is asked.
            "runtime": {
                "kind": "attach",
                "servers": [{"name": INSTANCE, "url": f"http://127.0.0.1:{vllm.port}"}],
            },
        }
        path = folder / "kvpilot.yaml"
        path.write_text(yaml.safe_dump(config))
        process = AgentProcess(path, port, folder / "agent.log")
        try:
            yield Agent(process.start(), folder / "state")
        finally:
            process.stop(timeout_s=20)


def _refused(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert words in error, error
    assert "Traceback" not in response.text


def _silence(**fields: Any) -> dict[str, Any]:
    return {"matchers": {"alertname": "KvSaturation"}, "duration_s": 60, **fields}


def _many_matchers(n: int) -> dict[str, Any]:
    return _silence(matchers={f"label_{i}": "x" * 100 for i in range(n)})


# -- authentication first -------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong", f"{TOKEN}x", TOKEN[:-1]])
@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"matchers": {"a": "b"}, "duration_s": 60}', id="sound"),
        pytest.param(b"[" * 100_000, id="deep"),
        pytest.param(b"\xff not json", id="garbage"),
    ],
)
def test_no_or_a_wrong_token_is_refused_before_the_body_is_read(
    agent: Agent, token: str | None, body: bytes
) -> None:
    before = agent.written()
    for path in (*CONTROL, f"/api/v1/breakers/{INSTANCE}/reset"):
        _refused(agent.post(path, token=token, content=body), 401, "token")
    assert agent.written() == before


def test_an_oversized_body_without_a_token_is_refused_unread(agent: Agent) -> None:
    response = agent.post("/api/v1/silences", token=None, content=b"{" * (11 << 20))
    _refused(response, 401, "token")


# -- size ------------------------------------------------------------------------------


def test_an_eleven_megabyte_silence_is_refused_and_not_stored(agent: Agent) -> None:
    before = agent.written()
    body = _many_matchers(100_000)
    response = agent.post("/api/v1/silences", json=body)
    _refused(response, 413, "over 65536 bytes")
    assert response.headers.get("connection") == "close"
    assert agent.written() == before


def test_a_chunked_body_is_cut_off_at_the_limit_not_buffered(agent: Agent) -> None:
    """No Content-Length: the agent stops reading past the limit and answers at once; the
    client is never made to send the whole body."""
    before = agent.written()
    total = 64 << 20
    sent = 0

    def body() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"duration_s": 60, "matchers": {'
        i = 0
        while sent < total:
            chunk = b"".join(b'"l%d": "v",' % n for n in range(i, i + 1000))
            i += 1000
            sent += len(chunk)
            yield chunk
        yield b'"z": "v"}}'

    response = agent.post("/api/v1/silences", content=body())
    _refused(response, 413, "over 65536 bytes")
    assert sent < total // 4, f"the client had to send {sent} bytes"
    assert agent.written() == before


def _raw_post(agent: Agent, head: str, body: bytes) -> tuple[int, bytes]:
    """One request written by hand (headers no client library would send): status, body."""
    host, port = agent.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        with contextlib.suppress(ConnectionResetError):
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize(
    ("length", "status"),
    [("99999999999", 413), ("x1", None), ("-5", None)],
)
def test_a_false_content_length_is_refused(agent: Agent, length: str, status: int | None) -> None:
    before = agent.written()
    body = b'{"matchers": {"a": "b"}, "duration_s": 60}'
    head = (
        "POST /api/v1/silences HTTP/1.1\nHost: kvpilot\nConnection: close\n"
        f"Authorization: Bearer {TOKEN}\nContent-Length: {length}\n"
    )
    got, _ = _raw_post(agent, head, body)
    assert got == status if status is not None else 400 <= got < 500
    assert agent.written() == before


def test_a_huge_nesting_is_refused_by_its_size(agent: Agent) -> None:
    before = agent.written()
    response = agent.post("/api/v1/silences", content=b"[" * 100_000 + b"]" * 100_000)
    _refused(response, 413, "over 65536 bytes")
    assert agent.written() == before


# -- shape -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", CONTROL)
@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" * 30_000 + b"]" * 30_000, id="deep-array"),
        pytest.param(b'{"matchers": ' + b'{"a": ' * 5_000 + b'"b"' + b"}" * 5_001, id="deep-obj"),
        pytest.param(b'{"matchers": {"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', id="brackets-in-str"),
    ],
)
def test_deep_json_is_refused_as_a_bad_request(agent: Agent, path: str, body: bytes) -> None:
    before = agent.written()
    response = agent.post(path, content=body)
    if body.startswith(b'{"matchers": {"a": "['):  # brackets inside a string are not depth
        assert response.status_code in (400, 422), response.text[:300]
        assert "nested" not in response.text
    else:
        _refused(response, 400, "nested deeper")
    assert agent.written() == before


@pytest.mark.parametrize(
    ("body", "words"),
    [
        pytest.param(b"", "not JSON", id="empty"),
        pytest.param(b"{'matchers': 1}", "not JSON", id="python-not-json"),
        pytest.param(b'{"matchers": {"a": "b"}, "duration_s": NaN}', "not JSON", id="nan"),
        pytest.param(b'{"matchers": {"a": "b"}, "duration_s": Infinity}', "not JSON", id="inf"),
        pytest.param(b'{"matchers": {"a": "\xff"}, "duration_s": 60}', "not UTF-8", id="latin1"),
    ],
)
def test_a_body_that_is_not_json_is_a_bad_request(agent: Agent, body: bytes, words: str) -> None:
    before = agent.written()
    _refused(agent.post("/api/v1/silences", content=body), 400, words)
    assert agent.written() == before


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(_many_matchers(33), id="33-matchers"),
        pytest.param(_silence(matchers={"a" * 129: "b"}), id="long-name"),
        pytest.param(_silence(matchers={"alertname": "v" * 257}), id="long-value"),
        pytest.param(_silence(matchers={"0bad name": "v"}), id="bad-label-name"),
        pytest.param(_silence(matchers={}), id="no-matchers"),
        pytest.param(_silence(matchers=[["alertname", "x"]]), id="matchers-a-list"),
        pytest.param(_silence(matchers={"alertname": 5}), id="value-a-number"),
        pytest.param(_silence(comment="c" * 501), id="long-comment"),
        pytest.param(_silence(duration_s="60"), id="duration-a-string"),
        pytest.param(_silence(duration_s=True), id="duration-a-bool"),
        pytest.param(_silence(duration_s=-1), id="negative-duration"),
        pytest.param(_silence(duration_s=31 * 86400), id="over-30-days"),
        pytest.param(_silence(extra=1), id="unknown-field"),
        pytest.param([_silence()], id="top-level-list"),
        pytest.param("silence", id="top-level-string"),
    ],
)
def test_an_unsound_silence_is_refused_and_not_stored(agent: Agent, body: Any) -> None:
    before = agent.written()
    response = agent.post("/api/v1/silences", json=body)
    _refused(response, 422, "invalid request")
    assert len(response.text) < 4000
    assert agent.written() == before


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/remediations", {"instance": 5}),
        ("/api/v1/remediations", {"instance": INSTANCE, "force": "yes"}),
        ("/api/v1/remediations", {"instance": INSTANCE, "reason": "r" * 501}),
        ("/api/v1/remediations", {"instance": "i" * 10_000}),
        ("/api/v1/vetoes", {"instance": INSTANCE}),
        ("/api/v1/vetoes", {"instance": INSTANCE, "incident_id": "abc", "reason": "both"}),
        ("/api/v1/vetoes", {"reason": "neither"}),
        ("/api/v1/vetoes", {"instance": [INSTANCE], "reason": "a list"}),
    ],
)
def test_unsound_control_requests_are_refused(agent: Agent, path: str, body: Any) -> None:
    before = agent.written()
    _refused(agent.post(path, json=body), 422, "invalid request")
    assert agent.written() == before


# -- unknown instances -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/vetoes", {"instance": "nonexistent", "reason": "typo"}),
        ("/api/v1/breakers/nonexistent/reset", None),
        ("/api/v1/remediations", {"instance": "nonexistent"}),
    ],
)
def test_an_unknown_instance_is_not_found_and_nothing_is_written(
    agent: Agent, path: str, body: dict[str, Any] | None
) -> None:
    before = agent.written()
    _refused(agent.post(path, json=body), 404, "unknown instance 'nonexistent'")
    assert agent.written() == before


# -- sound requests still work ---------------------------------------------------------


def test_sound_requests_within_the_limits_are_carried_out(agent: Agent) -> None:
    before = agent.written()
    made = agent.post("/api/v1/silences", json=_many_matchers(32) | {"comment": "c" * 500})
    assert made.status_code == 201, made.text[:300]
    vetoed = agent.post("/api/v1/vetoes", json={"instance": INSTANCE, "reason": "maintenance"})
    assert vetoed.status_code == 201, vetoed.text[:300]
    reset = agent.post(f"/api/v1/breakers/{INSTANCE}/reset")
    assert reset.status_code == 200, reset.text[:300]
    assert reset.json() == {"instance": INSTANCE, "was_open": False}
    after = agent.written()
    assert len(after["silences"]) == len(before["silences"]) + 1
    assert len(after["audit"]) == len(before["audit"]) + 3
    assert INSTANCE in after["vetoed"]
