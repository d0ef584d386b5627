"""The base of every settings model: an unknown key is an error, and a loaded value is frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Strict (no extra keys: a misspelt setting is refused, not ignored) and frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)
