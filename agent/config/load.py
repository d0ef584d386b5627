"""Loading: the YAML file (or data built from options), then `KVPILOT_*` environment
overrides, validated. Relative paths are relative to the agent's working directory.

Each layer goes over the one below it field by field: the YAML over the product's defaults
(the models keep a default section's other fields, see `agent/rules/config.py`), the
environment over the YAML (a mapping given in a variable merges into the YAML's mapping).
Lists are replaced whole. Input is read within the bounds of `bounded_yaml`; whatever is
wrong with it comes out as a ConfigError, never as another exception.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    ValidationError,
)

from kvpilot.agent.config.agent import AgentConfig, config_warnings
from kvpilot.agent.config.bounded_yaml import (
    MAX_DEPTH,
    YamlInputError,
    check_shape,
    read_yaml_file,
)
from kvpilot.agent.config.errors import ConfigError, env_value, format_validation_error, suggest

log = logging.getLogger(__name__)

ENV_PREFIX = "KVPILOT_"
ENV_NESTING = "__"


def load_config(
    path: Path | None, environ: Mapping[str, str] | None = None, *, warn: bool = True
) -> AgentConfig:
    """The YAML file (if any), then `KVPILOT_*` overrides from `environ`, validated."""
    return validate_config(_read_yaml(path) if path is not None else {}, environ, warn=warn)


def validate_config(
    data: dict[str, Any], environ: Mapping[str, str] | None = None, *, warn: bool = True
) -> AgentConfig:
    """Settings given as data (a parsed YAML, or built from command-line options), then
    `KVPILOT_*` overrides from `environ`, validated."""
    sources: dict[tuple[str, ...], str] = {}
    _check_shape(data)
    if environ is not None:
        data, sources = apply_env_overrides(data, environ)
        _check_shape(data)
    try:
        config = AgentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, AgentConfig, data, sources)) from None
    if warn:
        for note in config_warnings(config):
            log.warning("%s", note)
    return config


def _check_shape(data: Any) -> None:
    try:
        check_shape(data)
    except YamlInputError as exc:
        raise ConfigError([str(exc)]) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = read_yaml_file(path)
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    except YamlInputError as exc:
        raise ConfigError([f"{path}: {exc}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping, not {type(data).__name__}"])
    return data


def apply_env_overrides(
    data: dict[str, Any], environ: Mapping[str, str]
) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """Overlays `KVPILOT_SECTION__FIELD=value` on `data`; returns it and where each came from.

    Variables without `__` whose name is no top-level field belong to other parts of kvpilot
    (e.g. the plugin's `KVPILOT_KVPOOL_PORT`) and are left alone.
    """
    merged = _deep_copy(data)
    sources: dict[tuple[str, ...], str] = {}
    problems: list[str] = []
    top = set(AgentConfig.model_fields)
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split(ENV_NESTING)]
        if any(not p for p in parts):
            problems.append(f"{name}: empty name segment")
            continue
        if len(parts) >= MAX_DEPTH:
            problems.append(f"{name}: nested deeper than {MAX_DEPTH} levels")
            continue
        if parts[0] not in top:
            if len(parts) > 1:
                problems.append(f"{name}: {parts[0]}: unknown field{suggest(parts[0], top)}")
            continue
        try:
            _set_path(merged, parts, env_value(AgentConfig, parts, environ[name], merged))
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        sources[tuple(parts)] = name
    if problems:
        raise ConfigError(problems)
    return merged, sources


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _merged(below: Any, over: Any) -> Any:
    """`over` on `below`: mappings field by field, anything else (lists too) replaced whole."""
    if not isinstance(below, dict) or not isinstance(over, dict):
        return over
    return {**below, **{k: _merged(below.get(k), v) for k, v in over.items()}}


def _index(part: str, items: list[Any], here: str) -> int:
    if not (part.isascii() and part.isdigit()) or int(part) >= len(items):
        raise ValueError(f"{here}: no list item {part} to override")
    return int(part)


def _set_path(data: dict[str, Any], parts: list[str], value: Any) -> None:
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        here = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            node = node[_index(part, node, here)]
            continue
        child = node.setdefault(part, {})
        if not isinstance(child, dict | list):
            raise ValueError(f"{here} is {type(child).__name__}, not a mapping")
        node = child
    last = parts[-1]
    if isinstance(node, list):
        at = _index(last, node, ".".join(parts))
        node[at] = _merged(node[at], value)
    else:
        node[last] = _merged(node.get(last), value)
