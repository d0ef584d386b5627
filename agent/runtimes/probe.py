"""Readiness: /health answers 200 and a completion request is answered with tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvpilot.agent.runtimes.base import NotReady

PROBE_PROMPT_TOKEN_IDS = (1, 2, 3, 4)  # token ids: works with --skip-tokenizer-init too
PROBE_MAX_TOKENS = 2
POLL_S = 0.5
REQUEST_TIMEOUT_S = 30.0
START_MARKER = "===== kvpilot: start #"  # the header the local runtime writes at each start


class ProbeRejected(NotReady):
    """The server refused the probe in a way waiting will not fix (e.g. a wrong API key)."""


class StartFailed(NotReady):
    """The server's process ended, or never ran, before it was ready: waiting cannot help.

    `summary` is one plain sentence, `log_tail` what the server printed (its log's end),
    `hint` what to change when kvpilot can tell.
    """

    def __init__(
        self,
        summary: str,
        log_tail: str | None = None,
        *,
        hint: str | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.headline = summary if hint is None else f"{summary}; {hint}"
        super().__init__(self.headline, log_tail)
        self.summary = summary
        self.hint = hint
        self.log_path = log_path

    def explain(self, max_lines: int = 25) -> str:
        """For a person at a terminal: the log's last lines of this start, then what happened."""
        lines = []
        tail = this_start(self.log_tail)
        if tail:
            where = f" of {self.log_path}" if self.log_path else ""
            lines.append(f"--- the last lines{where} ---")
            lines += tail.splitlines()[-max_lines:]
            lines.append("---")
        lines.append(f"kvpilot: {self.summary}.")
        if self.hint:
            lines.append(f"kvpilot: {self.hint}.")
        return "\n".join(lines)


def this_start(log_tail: str | None) -> str:
    """The part of a log tail after the runtime's last start header (its own output only)."""
    text = log_tail or ""
    marker = text.rfind(START_MARKER)
    if marker >= 0:
        text = text[text.find("\n", marker) + 1 :] if "\n" in text[marker:] else ""
    return text.strip("\n")


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """A completed readiness check."""

    url: str
    model: str
    completion_tokens: int
    elapsed_s: float


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def probe_once(client: httpx.AsyncClient, url: str, api_key: str | None) -> tuple[str, int]:
    """One completion with a token-id prompt; returns (served model, completion tokens)."""
    headers = auth_headers(api_key)
    models = await client.get(f"{url}/v1/models", headers=headers)
    if models.status_code in (401, 403):
        raise ProbeRejected(f"{url}/v1/models refused the API key: HTTP {models.status_code}")
    models.raise_for_status()
    data = models.json().get("data") or []
    if not data:
        raise httpx.HTTPError(f"{url}/v1/models lists no model yet")
    model = str(data[0]["id"])
    body = {
        "model": model,
        "prompt": list(PROBE_PROMPT_TOKEN_IDS),
        "max_tokens": PROBE_MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    reply = await client.post(f"{url}/v1/completions", json=body, headers=headers)
    if reply.status_code in (401, 403):
        raise ProbeRejected(f"{url}/v1/completions refused the API key: HTTP {reply.status_code}")
    reply.raise_for_status()
    payload = reply.json()
    tokens = int((payload.get("usage") or {}).get("completion_tokens") or 0)
    if not payload.get("choices") or tokens < 1:
        raise NotReady(f"{url}/v1/completions answered without tokens: {payload!r}")
    return model, tokens


async def wait_ready(
    url: str,
    *,
    api_key: str | None,
    timeout_s: float,
    exited: Callable[[], str | None] = lambda: None,
    log_tail: Callable[[], str | None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = POLL_S,
    transport: httpx.AsyncBaseTransport | None = None,
) -> ProbeResult:
    """Wait until `url` is healthy and answers a probe with tokens, or raise NotReady.

    `exited` returns a reason once the server's process has gone, so a crash fails fast
    instead of running out the deadline.
    """
    started = clock()
    deadline = started + timeout_s
    last_error = "no answer yet"
    request_timeout_s = max(1.0, min(REQUEST_TIMEOUT_S, timeout_s))
    async with httpx.AsyncClient(timeout=request_timeout_s, transport=transport) as client:
        while True:
            gone = exited()
            if gone is not None:
                raise StartFailed(f"vLLM at {url} exited before it was ready ({gone})", log_tail())
            try:
                health = await client.get(f"{url}/health")
                if health.status_code == 200:
                    model, tokens = await probe_once(client, url, api_key)
                    return ProbeResult(url, model, tokens, clock() - started)
                last_error = f"/health answered HTTP {health.status_code}"
            except ProbeRejected:
                raise
            except (httpx.HTTPError, ValueError, KeyError, NotReady) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            if clock() >= deadline:
                raise NotReady(
                    f"vLLM at {url} not ready within {timeout_s:.0f} s (last: {last_error})",
                    log_tail(),
                )
            await asyncio.sleep(poll_s)
