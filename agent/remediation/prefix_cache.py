"""The light step: reset vLLM's prefix cache through its dev endpoint.

`POST /reset_prefix_cache` exists only with `VLLM_SERVER_DEV_MODE=1`, whose endpoints are
unauthenticated; the step runs only when the user enabled it. It answers
`{"success": bool}`, false while blocks are still held (by running requests, for example).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import httpx

from kvpilot.agent.model import Instance

REQUEST_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class LightStepResult:
    """Whether the light step took effect, and what the server said."""

    ok: bool
    reason: str


class LightStep(Protocol):
    async def reset_prefix_cache(self, instance: Instance) -> LightStepResult: ...


class HttpPrefixCacheReset:
    """Calls the server's `/reset_prefix_cache` (an API key is sent when one is given)."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._api_key = api_key
        self._timeout_s = timeout_s
        self._transport = transport

    async def reset_prefix_cache(self, instance: Instance) -> LightStepResult:
        url = f"{instance.url.rstrip('/')}/reset_prefix_cache"
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            async with httpx.AsyncClient(
                timeout=self._timeout_s, transport=self._transport
            ) as client:
                reply = await client.post(url, headers=headers)
        except httpx.HTTPError as exc:
            return LightStepResult(False, f"POST {url} failed: {type(exc).__name__}: {exc}")
        if reply.status_code == 404:
            return LightStepResult(
                False, f"POST {url}: 404 (the server runs without VLLM_SERVER_DEV_MODE=1)"
            )
        if reply.status_code != 200:
            return LightStepResult(False, f"POST {url}: HTTP {reply.status_code}")
        try:
            success = bool(reply.json().get("success"))
        except (ValueError, AttributeError):
            return LightStepResult(False, f"POST {url}: answer is not JSON: {reply.text[:200]!r}")
        if not success:
            return LightStepResult(False, "the server refused: blocks still held by requests")
        return LightStepResult(True, "prefix cache reset")
