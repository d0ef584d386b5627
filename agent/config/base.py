"""What the configuration's sections share besides their base (agent/strict_model.py): names,
ports, unique values, URLs."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field

NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"

Port = Annotated[int, Field(ge=1, le=65535)]


def require_unique(what: str, values: list[Any]) -> None:
    seen: set[Any] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what} {value!r} appears twice")
        seen.add(value)


def check_http_url(url: str) -> str:
    if not re.match(r"^https?://[^/\s]+", url):
        raise ValueError("must be an http:// or https:// URL")
    return url
