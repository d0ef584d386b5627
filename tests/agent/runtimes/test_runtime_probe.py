"""Readiness: health, then a completion answered with tokens, with the API key when set."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpilot.agent.runtimes.base import NotReady
from kvpilot.agent.runtimes.probe import ProbeRejected, ProbeResult, StartFailed, wait_ready

URL = "http://vllm.test:8000"


class FakeVllm:
    """Answers like vLLM's OpenAI server; `healthy_after` /health calls fail with 503 first."""

    def __init__(self, *, healthy_after: int = 0, api_key: str | None = None, tokens: int = 2):
        self.healthy_after = healthy_after
        self.api_key = api_key
        self.tokens = tokens
        self.health_calls = 0
        self.completions: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            self.health_calls += 1
            return httpx.Response(200 if self.health_calls > self.healthy_after else 503)
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return httpx.Response(401, json={"error": "Unauthorized"})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served-name"}]})
        if path == "/v1/completions":
            body = json.loads(request.content)
            self.completions.append(body)
            choices = [{"index": 0, "text": ""}] if self.tokens else []
            usage = {"completion_tokens": self.tokens}
            return httpx.Response(200, json={"choices": choices, "usage": usage})
        return httpx.Response(404)


def _wait(fake: FakeVllm, **kwargs: Any) -> ProbeResult:
    kwargs.setdefault("api_key", None)
    kwargs.setdefault("timeout_s", 5.0)
    return asyncio.run(wait_ready(URL, transport=httpx.MockTransport(fake), poll_s=0.0, **kwargs))


def test_waits_for_health_then_probes_the_served_model_with_token_ids() -> None:
    fake = FakeVllm(healthy_after=3, api_key="k")
    result = _wait(fake, api_key="k")
    assert fake.health_calls == 4
    (body,) = fake.completions
    assert body["model"] == "served-name"
    assert all(isinstance(t, int) for t in body["prompt"])
    assert body["max_tokens"] == 2
    assert result.model == "served-name" and result.completion_tokens == 2


def test_a_wrong_api_key_fails_at_once_instead_of_waiting() -> None:
    with pytest.raises(ProbeRejected, match="refused the API key: HTTP 401"):
        _wait(FakeVllm(api_key="right"), api_key="wrong", timeout_s=3600.0)


def test_an_answer_without_tokens_is_not_ready() -> None:
    with pytest.raises(NotReady, match=r"not ready within 0 s.*without tokens"):
        _wait(FakeVllm(tokens=0), timeout_s=0.2)


def test_an_exited_server_fails_fast_with_its_log() -> None:
    with pytest.raises(StartFailed, match=r"exited before it was ready \(exit code 1\)") as info:
        _wait(FakeVllm(), exited=lambda: "exit code 1", log_tail=lambda: "CUDA OOM")
    assert isinstance(info.value, NotReady)  # what callers of a runtime already catch
    assert info.value.log_tail == "CUDA OOM"
    assert "CUDA OOM" in str(info.value)
    assert info.value.explain().splitlines() == [
        "--- the last lines ---",
        "CUDA OOM",
        "---",
        "kvpilot: vLLM at http://vllm.test:8000 exited before it was ready (exit code 1).",
    ]


def test_the_explanation_keeps_only_the_last_starts_output() -> None:
    tail = (
        "first run's output\n\n===== kvpilot: start #2 of tiny at T: python -m vllm =====\n"
        "second run's error\n"
    )
    failed = StartFailed("it exited", tail, hint="do this", log_path=Path("/logs/tiny.log"))
    assert failed.explain().splitlines() == [
        "--- the last lines of /logs/tiny.log ---",
        "second run's error",
        "---",
        "kvpilot: it exited.",
        "kvpilot: do this.",
    ]


def test_the_deadline_names_the_last_problem() -> None:
    with pytest.raises(NotReady, match=r"last: /health answered HTTP 503"):
        _wait(FakeVllm(healthy_after=10**9), timeout_s=0.2)
