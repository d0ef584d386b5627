"""JSON for the agent's HTTP answers: NaN and ±Inf become null, so a reply is always JSON."""

from __future__ import annotations

import math
from typing import Any

from starlette.responses import JSONResponse


def finite(value: Any) -> Any:
    """`value` with every non-finite float (NaN, +Inf, -Inf) replaced by None.

    Missing is null in kvpilot's JSON; a non-finite number is no figure at all, and strict
    JSON has no spelling for it (Python's `NaN`/`Infinity` tokens break every other parser).
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


class JsonResponse(JSONResponse):
    """Starlette's JSON response, with non-finite floats rendered as null."""

    def render(self, content: Any) -> bytes:
        return super().render(finite(content))


def error_response(
    status_code: int, message: str, *, close: bool = False, **extra: Any
) -> JsonResponse:
    """`{"error": message, ...}`; `close` ends the connection (a request body left unread)."""
    headers = {"Connection": "close"} if close else None
    return JsonResponse({"error": message, **extra}, status_code, headers=headers)
