"""Configuration input within bounds: file size, nesting depth, values once aliases expand.

PyYAML builds an alias as one more reference to the object it names, so a few lines of
aliases of aliases parse in an instant into a graph whose expansion, by anything that walks or
copies it (the overrides, validation), takes gigabytes. The loader here keeps, while it
composes and before anything is built, the count of values the document holds with every
alias expanded, and their depth, and refuses past the bounds. `check_shape` applies the same
bounds to data from elsewhere (command-line options, environment overrides merged in).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from yaml.error import Mark
from yaml.nodes import MappingNode, Node, SequenceNode

from kvpilot.collectors.secrets import mask_text

MAX_FILE_BYTES = 1024 * 1024
MAX_DEPTH = 32
MAX_VALUES = 100_000


# What PyYAML's constructors let through on a value Python cannot hold (a 5000-digit int,
# February 30th) or on a malformed tagged scalar (`!!timestamp` with no date): the
# exceptions of Python's own conversions, raised from inside the constructor.
_MALFORMED_VALUE = (ArithmeticError, AttributeError, LookupError, TypeError, ValueError)


class YamlInputError(ValueError):
    """Input kvpilot refuses to read; the message says why and where, without the source."""


def _at(mark: Mark | None) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's message without its quote of the offending line, which may hold a password
    (a URL's user-info, a token): the problem and where, masked as text all the same."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return mask_text(str(exc))  # a reader error names a character and an offset
    said = [(exc.context, exc.context_mark), (exc.problem, exc.problem_mark), (exc.note, None)]
    parts = [f"{text} at {_at(mark)}" if mark else text for text, mark in said if text]
    return mask_text("; ".join(parts) or type(exc).__name__)


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader, counting every value at its expanded size and depth as it composes."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._open = 0  # the node being composed and the collections around it
        self._values = 0  # values so far, each alias counted as what it expands to
        self._measured: dict[int, tuple[int, int]] = {}  # id(node): (expanded size, height)

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        # types-PyYAML leaves Parser.peek_event unannotated; it returns an Event.
        mark: Mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            measured = self._measured.get(id(node))
            if measured is None:  # its collection is still being composed
                raise YamlInputError(
                    f"{_at(mark)}: the alias refers to a collection that contains it"
                )
            size, height = measured
            self._count(size, self._open + height, mark)
            return node
        self._open += 1
        self._count(1, self._open, mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._open -= 1
        if node is not None:
            self._measured[id(node)] = self._measure(node)
        return node

    def _count(self, values: int, depth: int, mark: Mark | None) -> None:
        self._values += values
        if depth > MAX_DEPTH:
            raise YamlInputError(f"{_at(mark)}: nested deeper than {MAX_DEPTH} levels")
        if self._values > MAX_VALUES:
            raise YamlInputError(
                f"{_at(mark)}: more than {MAX_VALUES} values once aliases are expanded"
            )

    def _measure(self, node: Node) -> tuple[int, int]:
        if isinstance(node, SequenceNode):
            children = list(node.value)
        elif isinstance(node, MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            return 1, 1
        measured = [self._measured[id(child)] for child in children]
        return 1 + sum(s for s, _ in measured), 1 + max((h for _, h in measured), default=0)


def load_yaml(text: str) -> Any:
    """One YAML document, within the bounds; YamlInputError otherwise."""
    try:
        loader = _BoundedLoader(text)  # reads the first characters already
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except YamlInputError:
        raise
    except yaml.YAMLError as exc:
        raise YamlInputError(f"not valid YAML: {_yaml_problem(exc)}") from None
    except _MALFORMED_VALUE as exc:
        raise YamlInputError(f"not a value kvpilot can read: {exc}") from None


def read_yaml_file(path: Path) -> Any:
    """The YAML document in `path`; OSError when it cannot be read, YamlInputError when it is
    too large, not UTF-8, not YAML or beyond the bounds."""
    with path.open("rb") as stream:
        raw = stream.read(MAX_FILE_BYTES + 1)  # never more, whatever the file is
    if len(raw) > MAX_FILE_BYTES:
        raise YamlInputError(f"larger than {MAX_FILE_BYTES} bytes (1 MiB), the most kvpilot reads")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise YamlInputError(
            f"not UTF-8 text: {exc.reason} at byte offset {exc.start} (line {line})"
        ) from None
    return load_yaml(text)


def check_shape(data: Any) -> None:
    """Refuses data nested deeper than MAX_DEPTH (a cycle is infinitely deep) or holding more
    than MAX_VALUES values, counted as the YAML loader counts them (keys included)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    values = 0
    while stack:
        value, path = stack.pop()
        values += 1
        if len(path) >= MAX_DEPTH:
            where = ".".join(path[:3])
            raise YamlInputError(f"{where}...: nested deeper than {MAX_DEPTH} levels")
        if values > MAX_VALUES:
            raise YamlInputError(f"more than {MAX_VALUES} values")
        if isinstance(value, Mapping):
            for key, item in value.items():
                name = key[:40] if isinstance(key, str) else f"<{type(key).__name__}>"
                stack.append((key, (*path, name)))
                stack.append((item, (*path, name)))
        elif isinstance(value, list | tuple | set | frozenset):
            stack.extend((item, (*path, str(i))) for i, item in enumerate(value))


__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_VALUES",
    "YamlInputError",
    "check_shape",
    "load_yaml",
    "read_yaml_file",
]
