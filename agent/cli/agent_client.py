"""A running agent's control API, as the operator commands reach it: one HTTP client, one
error policy. Every failure becomes an `AgentError` with a sentence an operator can act on
(never a traceback, never the token)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvpilot.collectors.safe_files import MAX_TOKEN_FILE_BYTES, UnsafeFile, read_small_file
from kvpilot.collectors.secrets import mask_url

DEFAULT_AGENT_URL = "http://127.0.0.1:8474"
TOKEN_ENV = "KVPILOT_API_TOKEN"  # noqa: S105  (the variable's name, not a secret)
DEFAULT_TIMEOUT_S = 10.0
MAX_ERROR_CHARS = 300


class AgentError(Exception):
    """The agent could not be reached or refused the request; the message says why."""


@dataclass(frozen=True, slots=True)
class AgentAddress:
    """Where the agent listens and the bearer token its control routes want (None: reads
    only). `repr` leaves the token out so that it never reaches a log or a traceback."""

    url: str
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __repr__(self) -> str:
        return f"AgentAddress(url={mask_url(self.url)!r}, token={'set' if self.token else None})"


def read_token(token_file: Path | None, environ: dict[str, str] | None = None) -> str | None:
    """The token from `token_file` (a mounted Secret) or else `KVPILOT_API_TOKEN`."""
    if token_file is not None:
        try:
            text = read_small_file(token_file, MAX_TOKEN_FILE_BYTES).decode().strip()
        except (OSError, UnsafeFile, UnicodeDecodeError) as exc:
            raise AgentError(f"cannot read the token file {token_file}: {exc}") from None
        if not text:
            raise AgentError(f"the token file {token_file} is empty")
        return text
    env = os.environ if environ is None else environ
    return env.get(TOKEN_ENV) or None


class AgentClient:
    """`get`, `post` and `delete` on the agent's `/api/v1`, each answering the JSON body.
    `feature` names what the call is for, so that an agent without the route is reported
    as one that does not support it (an older agent), not as a bare 404."""

    def __init__(self, address: AgentAddress, transport: httpx.BaseTransport | None = None):
        self._address = address
        headers = {"Authorization": f"Bearer {address.token}"} if address.token else {}
        self._http = httpx.Client(
            base_url=address.url.rstrip("/"),
            headers=headers,
            timeout=address.timeout_s,
            transport=transport,
            follow_redirects=False,
        )

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def get(self, path: str, feature: str, params: dict[str, str] | None = None) -> Any:
        return self._call("GET", path, feature, params=params)

    def post(self, path: str, feature: str, body: dict[str, Any] | None = None) -> Any:
        return self._call("POST", path, feature, body=body if body is not None else {})

    def delete(self, path: str, feature: str, body: dict[str, Any] | None = None) -> Any:
        return self._call("DELETE", path, feature, body=body)

    def _call(
        self,
        method: str,
        path: str,
        feature: str,
        *,
        params: dict[str, str] | None = None,
        body: dict[str, Any] | None = None,
    ) -> Any:
        where = mask_url(self._address.url)
        try:
            response = self._http.request(method, path, params=params, json=body)
        except httpx.TimeoutException:
            raise AgentError(
                f"the agent at {where} did not answer within {self._address.timeout_s:g} s"
            ) from None
        except httpx.HTTPError as exc:
            raise AgentError(
                f"cannot reach the agent at {where} ({type(exc).__name__}: {exc}); is "
                "`kvpilot run` listening there? In Kubernetes: `kubectl port-forward "
                "pod/POD 8474` first"
            ) from None
        return _answer(response, method, path, feature, where)


def _answer(response: httpx.Response, method: str, path: str, feature: str, where: str) -> Any:
    status = response.status_code
    detail = _detail(response)
    if status in (404, 405) and _no_such_route(response, detail):
        raise AgentError(
            f"this agent does not support {feature} ({method} {path} answered {status}); "
            "upgrade the agent"
        )
    if status == 401:
        raise AgentError(
            f"the agent refused the token: give the right one with --token-file or {TOKEN_ENV}"
        )
    if status == 403:
        raise AgentError(f"the agent refused the request: {detail}")
    if status >= 400:
        raise AgentError(f"{method} {path} failed with HTTP {status}: {detail}")
    try:
        return response.json()
    except ValueError:
        raise AgentError(f"{where} answered {status} with a body that is not JSON") from None


def _detail(response: httpx.Response) -> str:
    """The agent's own error sentence (and its problems) when it gave one, else the text."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:MAX_ERROR_CHARS]
    if not isinstance(data, dict):
        return str(data)[:MAX_ERROR_CHARS]
    text = str(data.get("error", data))
    problems = data.get("problems")
    if isinstance(problems, list) and problems:
        text += ": " + "; ".join(str(p) for p in problems)
    return text[:MAX_ERROR_CHARS]


def _no_such_route(response: httpx.Response, detail: str) -> bool:
    """A 404 the router gave (no route: Starlette's "Not Found"), not one a handler gave
    (an unknown instance says what it did not know). A 405: the path serves other methods."""
    return response.status_code == 405 or detail == "Not Found"
