"""JSON a scraped server sends, parsed within bounds: depth counted by a flat scan first, since
`json.loads` recurses once per level and a body of 100,000 `[` raises RecursionError deep
inside it; NaN and Infinity refused; integers past Python's digit limit refused (a ValueError
that the caller sees as such). Every failure is a `JsonBodyError` with a short reason."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 32  # vLLM's JSON answers nest a few levels
# A JSON string (escapes included, possibly unterminated) or one bracket: strings are skipped
# whole, so brackets inside them are not counted.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]', re.DOTALL)


class JsonBodyError(ValueError):
    """The body is not JSON this client reads: the message says why."""


def nesting_depth(text: str, stop_above: int) -> int:
    """The deepest nesting of arrays and objects in `text`, counting stopped past `stop_above`."""
    depth = deepest = 0
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > stop_above:
                break
        elif token in ("]", "}"):
            depth -= 1
    return deepest


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number")


def loads(text: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in `text`, at most `max_depth` deep; JsonBodyError says why not."""
    if nesting_depth(text, max_depth) > max_depth:
        raise JsonBodyError(f"JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, digits past the int limit
        raise JsonBodyError(f"not JSON: {str(e)[:120]}") from None
