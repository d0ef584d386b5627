"""Configuration errors that name the field and the problem, and typing of environment values.

Both need to know which model field a path like `runtime.instances.0.argv` lands on; `walk`
follows such a path through the pydantic models (tagged unions, lists, mappings included).
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr, ValidationError

from kvpilot.agent.config.bounded_yaml import YamlInputError, load_yaml
from kvpilot.collectors.secrets import is_secret_name, mask_text

_SCALARS = (str, int, float, bool, type(None))
_MAX_SHOWN_CHARS = 60


class ConfigError(Exception):
    """An invalid configuration; `problems` has one line per problem, each naming its field."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True, slots=True)
class Walked:
    """Where a location path lands: the path without union tags, the field's type, its model."""

    path: tuple[str, ...]
    annotation: Any  # None when the path leaves the models
    parent: type[BaseModel] | None  # the model whose field the last part names


def _strip_annotated(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _members(annotation: Any) -> list[Any]:
    annotation = _strip_annotated(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return [_strip_annotated(a) for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _tag_of(model: type[BaseModel]) -> str | None:
    field = model.model_fields.get("kind")
    args = get_args(field.annotation) if field is not None else ()
    return args[0] if len(args) == 1 and isinstance(args[0], str) else None


def walk(root: type[BaseModel], loc: Sequence[str | int], data: Any = None) -> Walked:
    """Follows `loc` from `root`; `data` (the raw input) picks union members by their `kind`."""
    annotation: Any = root
    path: list[str] = []
    parent: type[BaseModel] | None = None
    for part in loc:
        members = _members(annotation) if annotation is not None else []
        models = [m for m in members if _is_model(m)]
        if len(models) > 1:
            by_tag = {_tag_of(m): m for m in models}
            if part in by_tag:  # pydantic names the chosen member in the location
                annotation = by_tag[part]
                continue
            tag = data.get("kind") if isinstance(data, Mapping) else None
            models = [by_tag[tag]] if tag in by_tag else []
        single = members[0] if len(members) == 1 else None
        annotation = models[0] if models else single
        path.append(str(part))
        origin = get_origin(annotation)
        if _is_model(annotation) and isinstance(part, str):
            parent = annotation
            field = annotation.model_fields.get(part)
            annotation = field.annotation if field is not None else None
            data = data.get(part) if isinstance(data, Mapping) else None
        elif origin in (list, tuple, Sequence) and isinstance(part, int):
            annotation = get_args(annotation)[0] if get_args(annotation) else None
            ok = isinstance(data, list) and 0 <= part < len(data)
            data = data[part] if ok else None
        elif origin in (dict, Mapping):
            annotation = get_args(annotation)[1] if get_args(annotation) else None
            data = data.get(part) if isinstance(data, Mapping) else None
        else:
            annotation, data = None, None
    return Walked(tuple(path), annotation, parent)


def _is_secret(annotation: Any) -> bool:
    return any(m is SecretStr for m in _members(annotation)) if annotation is not None else False


def _is_text(annotation: Any) -> bool:
    members = _members(annotation) if annotation is not None else []
    return bool(members) and all(m in (str, SecretStr, Path) for m in members)


def suggest(word: str, candidates: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the closest candidate, or "" when none is close."""
    close = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _shown(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > _MAX_SHOWN_CHARS * 4:
        return f"an integer of {value.bit_length()} bits"  # str() refuses the longest ones
    shown = repr(value) if isinstance(value, str) else str(value)
    if len(shown) > _MAX_SHOWN_CHARS:
        shown = shown[: _MAX_SHOWN_CHARS - 3] + "..."
    return shown


def _may_be_secret(path: Sequence[str], data: Any) -> bool:
    """Whether the input at `path` (a walked one: no union tags) may be a secret that its
    field's type does not say: under a name that says so (`env.HF_TOKEN`, `headers.X-Api-Key`),
    or an argv's value of a secret flag (`--api-key 12345678`): a wrong type (a number) must
    not show it either."""
    if any(is_secret_name(part) for part in path):
        return True
    parent: Any = data
    for part in path[:-1]:
        parent = _item(parent, part)
    last = _index_of(path[-1]) if path else None
    if not (isinstance(parent, list) and last is not None and 0 < last < len(parent)):
        return False
    before = parent[last - 1]
    return isinstance(before, str) and before.startswith("-") and is_secret_name(before)


def _index_of(part: str) -> int | None:
    return int(part) if part.isascii() and part.isdigit() else None


def _item(value: Any, part: str) -> Any:
    """`value[part]` of the raw input, or None where there is no such item."""
    if isinstance(value, Mapping):
        return value.get(part)
    index = _index_of(part)
    if isinstance(value, list) and index is not None and index < len(value):
        return value[index]
    return None


def format_validation_error(
    exc: ValidationError,
    root: type[BaseModel],
    data: Any,
    sources: Mapping[tuple[str, ...], str] | None = None,
) -> list[str]:
    """One line per error: `path: problem (got value)`, secrets never shown."""
    lines = []
    errors = exc.errors(include_url=False)
    deeper = {tuple(e["loc"][:i]) for e in errors for i in range(len(e["loc"]))}
    for error in errors:
        if error["type"] == "too_short" and tuple(error["loc"]) in deeper:
            continue  # pydantic counts only the valid items; the items' own errors say more
        walked = walk(root, error["loc"], data)
        where = ".".join(walked.path) or "(top level)"
        kind = error["type"]
        if kind == "extra_forbidden":
            names = walked.parent.model_fields if walked.parent is not None else ()
            retired = getattr(walked.parent, "retired_fields", {})
            if walked.path[-1] in retired:
                problem = f"no longer supported: {retired[walked.path[-1]]}"
            else:
                problem = f"unknown field{suggest(walked.path[-1], names)}"
        else:
            problem = error["msg"].removeprefix("Value error, ")
            value = error.get("input")
            if (
                kind != "missing"
                and isinstance(value, _SCALARS)
                and not _is_secret(walked.annotation)
                and not _may_be_secret(walked.path, data)
            ):
                problem += f" (got {_shown(value)})"
            problem = mask_text(problem)  # a URL's password, in the value or in the message
        origin = (sources or {}).get(walked.path)
        if origin is not None:
            problem += f" [from {origin}]"
        lines.append(f"{where}: {problem}")
    return lines


def env_value(root: type[BaseModel], parts: Sequence[str], raw: str, data: Any) -> Any:
    """An environment value typed as YAML (within the loader's bounds), except text fields keep
    the raw string."""
    loc: list[str | int] = [int(p) if p.isascii() and p.isdigit() else p for p in parts]
    if _is_text(walk(root, loc, data).annotation):
        return raw
    try:
        return load_yaml(raw) if raw.strip() else raw
    except YamlInputError as exc:
        raise ValueError(str(exc)) from None


__all__ = ["ConfigError", "Walked", "env_value", "format_validation_error", "suggest", "walk"]
