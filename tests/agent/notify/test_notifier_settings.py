"""Notifier settings from the configuration reach the requests: each notifier's own timeout,
Alertmanager's extra headers; against a real HTTP receiver on loopback."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvpilot.agent.app.parts import build_notifiers
from kvpilot.agent.cli.config_cmd import summary
from kvpilot.agent.config import AgentConfig, ConfigError, load_config
from kvpilot.agent.notify import DeliveryError, Notifier
from tests.agent.notify.notify_helpers import make_event
from tests.agent.notify.notify_receiver import Receiver

PROXY_TOKEN = "prx-5c1e0a9d44"  # a header value: secret, never in a repr, an error or a log
BEARER = "bearer-77ab3e01f2"


def _kinds(url: str) -> dict[str, dict[str, Any]]:
    return {
        "webhook": {"kind": "webhook", "url": f"{url}/hook"},
        "alertmanager": {"kind": "alertmanager", "url": url},
        "slack": {"kind": "slack", "url": f"{url}/services/T0/B0/x"},
    }


def _config(*notifiers: dict[str, Any]) -> AgentConfig:
    return AgentConfig.model_validate(
        {"runtime": {"kind": "process", "port": 8000}, "notifiers": list(notifiers)}
    )


def _with_notifier(
    settings: dict[str, Any],
    client_timeout: httpx.Timeout,
    body: Callable[[Notifier], Awaitable[None]],
) -> None:
    """`body` with the notifier the configuration builds, on a client like the sidecar's."""

    async def main() -> None:
        async with httpx.AsyncClient(timeout=client_timeout) as client:
            (notifier,) = build_notifiers(_config(settings).notifiers, client, "").values()
            await body(notifier)

    asyncio.run(main())


# The sidecar's shared client waits 5 s for an answer.
SIDECAR_TIMEOUT = httpx.Timeout(5.0, connect=2.0)


@pytest.mark.parametrize("kind", ["webhook", "alertmanager", "slack"])
def test_a_notifier_gives_up_after_its_own_timeout(receiver: Receiver, kind: str) -> None:
    receiver.hang()
    settings = {**_kinds(receiver.url)[kind], "timeout_s": 0.5}
    took: list[float] = []

    async def body(notifier: Notifier) -> None:
        started = time.monotonic()
        with pytest.raises(DeliveryError) as caught:
            await notifier.send([make_event()])
        took.append(time.monotonic() - started)
        assert caught.value.retryable
        assert "timed out after 0.5 s" in caught.value.message

    try:
        _with_notifier(settings, SIDECAR_TIMEOUT, body)
    finally:
        receiver.release()
    assert 0.4 <= took[0] < 3.0, f"gave up after {took[0]:.2f} s, not ~0.5 s"


@pytest.mark.parametrize("kind", ["webhook", "alertmanager", "slack"])
def test_a_notifier_waits_its_own_timeout_beyond_the_clients(receiver: Receiver, kind: str) -> None:
    receiver.hang()
    answer = threading.Timer(0.8, receiver.release)  # the receiver answers after 0.8 s
    settings = {**_kinds(receiver.url)[kind], "timeout_s": 10}

    async def body(notifier: Notifier) -> None:
        answer.start()
        await notifier.send([make_event()])  # the client alone would give up at 0.2 s

    try:
        _with_notifier(settings, httpx.Timeout(0.2), body)
    finally:
        answer.cancel()
        receiver.release()
    assert len(receiver.accepted()) == 1


def _alertmanager(url: str) -> dict[str, Any]:
    return {
        "kind": "alertmanager",
        "url": url,
        "headers": {"X-Scope-OrgID": "tenant-a", "X-Proxy-Token": PROXY_TOKEN},
        "auth": {"bearer_token": BEARER},
    }


def test_alertmanager_sends_its_headers_on_every_push(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    firing = make_event()
    resolved = make_event(status="resolved")
    receiver.answer(200, times=2)
    receiver.answer(500)
    seen: list[str] = []

    async def body(notifier: Notifier) -> None:
        await notifier.send([firing])
        await notifier.send([resolved, make_event(instance="vllm-1")])
        with pytest.raises(DeliveryError) as caught:
            await notifier.send([firing])
        seen.extend([repr(notifier), str(caught.value)])

    with caplog.at_level(logging.DEBUG):
        _with_notifier(_alertmanager(receiver.url), SIDECAR_TIMEOUT, body)
    pushes = receiver.received()
    assert len(pushes) == 3
    for push in pushes:
        assert push.path == "/api/v2/alerts"
        assert push.headers["x-scope-orgid"] == "tenant-a"
        assert push.headers["x-proxy-token"] == PROXY_TOKEN
        assert push.headers["authorization"] == f"Bearer {BEARER}"
        assert push.headers["content-type"] == "application/json"
    for text in [*seen, caplog.text]:
        assert PROXY_TOKEN not in text and BEARER not in text


def test_the_summary_names_alertmanager_headers_and_hides_their_values(tmp_path: Path) -> None:
    lines = "\n".join(summary(_config(_alertmanager("http://am:9093"))))
    assert "headers: X-Proxy-Token, X-Scope-OrgID (values hidden)" in lines
    assert PROXY_TOKEN not in lines and BEARER not in lines


def _problems(tmp_path: Path, notifier: dict[str, Any]) -> list[str]:
    path = tmp_path / "kvpilot.yaml"
    path.write_text(
        yaml.safe_dump({"runtime": {"kind": "process", "port": 8000}, "notifiers": [notifier]})
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return list(caught.value.problems)


def test_authorization_twice_is_refused(tmp_path: Path) -> None:
    notifier = {**_alertmanager("http://am:9093"), "headers": {"authorization": PROXY_TOKEN}}
    (problem,) = _problems(tmp_path, notifier)
    assert problem.startswith("notifiers.0.headers: ")
    assert "Authorization" in problem and "auth" in problem
    assert PROXY_TOKEN not in problem


@pytest.mark.parametrize("kind", ["webhook", "alertmanager"])
@pytest.mark.parametrize(
    ("headers", "says"),
    [
        ("X-Token: abc", "valid dictionary"),
        (["X-Token", "abc"], "valid dictionary"),
        ({"X-Token": {"nested": PROXY_TOKEN}}, "string"),
        ({"X Token": PROXY_TOKEN}, "'X Token' is not a header name"),
        ({"X-Token:": PROXY_TOKEN}, "is not a header name"),
        ({"X-Token": f"{PROXY_TOKEN}\r\nX-Injected: 1"}, "'X-Token': the value has a line break"),
        ({"X-Token": f"{PROXY_TOKEN}\0"}, "'X-Token': the value has a control character"),
    ],
)
def test_hostile_headers_are_clear_errors_without_their_values(
    tmp_path: Path, kind: str, headers: Any, says: str
) -> None:
    notifier = {**_kinds("http://h:1")[kind], "headers": headers}
    found = _problems(tmp_path, notifier)
    assert found and all(p.startswith("notifiers.0.headers") for p in found), found
    assert says in "\n".join(found)
    assert PROXY_TOKEN not in "\n".join(found)


@pytest.mark.parametrize("kind", ["webhook", "alertmanager", "slack"])
@pytest.mark.parametrize(
    ("timeout", "says"),
    [
        ("soon", "valid number"),
        (0, "greater than 0"),
        (-1, "greater than 0"),
        ([1], "valid number"),
        (".inf", "finite number"),
        (True, "a number of seconds, not true or false"),
    ],
)
def test_a_timeout_that_is_no_positive_number_is_a_clear_error(
    tmp_path: Path, kind: str, timeout: Any, says: str
) -> None:
    value = float("inf") if timeout == ".inf" else timeout
    (problem,) = _problems(tmp_path, {**_kinds("http://h:1")[kind], "timeout_s": value})
    assert problem.startswith("notifiers.0.timeout_s: ") and says in problem
