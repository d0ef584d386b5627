"""A fast parser for the Prometheus text exposition format (and OpenMetrics text).

Speed comes from two things. A line whose metric name does not start with one of the
caller's prefixes is dropped with one ``str.startswith`` before anything else is read. And
a line's head (``name{labels}``) is parsed once and cached: a server exports the same
series scrape after scrape, so a steady-state line costs a split, a cache lookup and a
``float()``. The caches are bounded in bytes (``ByteBudgetMemo``, thread-safe): label values
that change on every scrape, or run long, cost at most the budget. Comments
(``# HELP``, ``# TYPE``) carry nothing this module needs and are skipped; ``# EOF`` ends
the input.

Tolerated: OpenMetrics ``# EOF``, ``_created`` samples present or absent, timestamps after
values, exemplars (``# {...} v``) after values, escaped label values, ``NaN``, ``+Inf``,
``-Inf``, CRLF line ends, a trailing comma in a label block. ``MetricsParseError`` (and its
``SampleLimitError``, for a body with more samples than the caller allows) is the only
exception this module raises.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise

from kvpilot.collectors.bytecache import ByteBudgetMemo

Labels = tuple[tuple[str, str], ...]


class MetricsParseError(ValueError):
    """The text is not a valid exposition; carries the line number and a short excerpt."""

    def __init__(self, reason: str, *, line_no: int | None = None, line: str = "") -> None:
        self.reason = reason
        self.line_no = line_no
        self.excerpt = line[:80] + ("..." if len(line) > 80 else "")
        where = f"line {line_no}: " if line_no is not None else ""
        tail = f": {self.excerpt!r}" if line else ""
        super().__init__(f"{where}{reason}{tail}")


class SampleLimitError(MetricsParseError):
    """The exposition holds more sample lines than the caller's limit (Prometheus's
    ``sample_limit``): the whole body is refused, as Prometheus refuses the scrape."""

    def __init__(self, limit: int, *, line_no: int) -> None:
        self.limit = limit
        super().__init__(f"more than {limit} samples", line_no=line_no)


@dataclass(frozen=True, slots=True)
class MetricSample:
    """One sample line: metric name, labels sorted by name, value."""

    name: str
    labels: Labels
    value: float


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# A label block: '{' up to the first '}' that is not inside a quoted value.
_LABEL_BLOCK = re.compile(r'\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\}')
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,|$)')
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPED = {"\\": "\\", '"': '"', "n": "\n"}
_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")
_BLANK = frozenset(" \t\r")


class _LabelError(Exception):
    """A label block that does not parse (wrapped with its line number by the caller)."""


def parse_samples(
    text: str, *, prefixes: tuple[str, ...] | None = None, sample_limit: int | None = None
) -> list[MetricSample]:
    """All samples in ``text`` (only those whose name starts with one of ``prefixes``, if given)."""
    return [
        MetricSample(name, labels, value)
        for name, labels, value in scan(text, prefixes=prefixes, sample_limit=sample_limit)
    ]


def clear_caches() -> None:
    """Forget every parsed line head and label block (for cold-start measurements)."""
    _parse_head.clear()
    _parse_labels.clear()


def scan(
    text: str, *, prefixes: tuple[str, ...] | None = None, sample_limit: int | None = None
) -> Iterator[tuple[str, Labels, float]]:
    """Yield ``(name, labels, value)`` per sample line: ``parse_samples`` without the objects.

    Lines skipped by ``prefixes`` get only a cheap check of their first character, except a
    last line without a trailing newline, which is parsed in full: that is where a truncated
    body shows. Every sample line counts against ``sample_limit``, skipped ones included;
    past it ``SampleLimitError`` is raised.
    """
    lines = text.split("\n")
    last = len(lines) - 1 if text and not text.endswith("\n") else -1
    budget = len(lines) if sample_limit is None else sample_limit
    for i, line in enumerate(lines):
        if not line:
            continue
        first = line[0]
        if first in _BLANK:  # rare: indented or blank-looking lines
            line = line.strip(" \t\r")
            if not line:
                continue
            first = line[0]
        if first == "#":
            if line.startswith("# EOF"):
                return
            continue
        budget -= 1
        if budget < 0:
            raise SampleLimitError(sample_limit or 0, line_no=i + 1)
        if prefixes is not None and i != last and not line.startswith(prefixes):
            if first not in _NAME_START:
                raise MetricsParseError("not a sample line", line_no=i + 1, line=line)
            continue
        # Fast path: "name{labels} value", whose head repeats scrape after scrape.
        head, sep, token = line.rpartition(" ")
        parsed = _parse_head(head) if sep else None
        if parsed is not None and token and "_" not in token:
            try:
                sample = (parsed[0], parsed[1], float(token))
            except ValueError:
                sample = _parse_line(line, i + 1)  # raises with the reason
        else:  # timestamps, exemplars, odd spacing, errors
            sample = _parse_line(line, i + 1)
        if i != last or prefixes is None or line.startswith(prefixes):
            yield sample


def _parse_head_uncached(head: str) -> tuple[str, Labels] | None:
    """``name`` or ``name{labels}`` exactly; None for anything else (the slow path decides)."""
    m = _NAME.match(head)
    if m is None:
        return None
    pos = m.end()
    if pos == len(head):
        return head, ()
    if head[pos] != "{" or head[-1] != "}":
        return None
    block = _LABEL_BLOCK.match(head, pos)
    if block is None or block.end() != len(head):
        return None
    try:
        return m.group(), _parse_labels(block.group(1))
    except _LabelError:
        return None


def _parse_line(line: str, line_no: int) -> tuple[str, Labels, float]:
    """Parse one sample line."""
    m = _NAME.match(line)
    if m is None:
        raise MetricsParseError("expected a metric name", line_no=line_no, line=line)
    name = m.group()
    pos = m.end()
    labels: Labels = ()
    if pos < len(line) and line[pos] == "{":
        block = _LABEL_BLOCK.match(line, pos)
        if block is None:
            raise MetricsParseError("unterminated label block", line_no=line_no, line=line)
        try:
            labels = _parse_labels(block.group(1))
        except _LabelError as e:
            raise MetricsParseError(str(e), line_no=line_no, line=line) from None
        pos = block.end()
    rest = line[pos:]
    if not rest or rest[0] not in _BLANK:
        raise MetricsParseError("expected a space before the value", line_no=line_no, line=line)
    hash_at = rest.find("#")
    if hash_at >= 0:  # an OpenMetrics exemplar follows the value
        rest = rest[:hash_at]
    fields = rest.split()
    if not 1 <= len(fields) <= 2:
        raise MetricsParseError(
            "expected a value and an optional timestamp", line_no=line_no, line=line
        )
    value = _number(fields[0], line_no, line)
    if len(fields) == 2:
        _number(fields[1], line_no, line)  # a timestamp: validated, not kept
    return name, labels, value


def _number(token: str, line_no: int, line: str) -> float:
    """A float as Go's ParseFloat reads it (no digit separators)."""
    if "_" in token:
        raise MetricsParseError(f"invalid number {token[:20]!r}", line_no=line_no, line=line)
    try:
        return float(token)
    except ValueError:
        raise MetricsParseError(
            f"invalid number {token[:20]!r}", line_no=line_no, line=line
        ) from None


def _parse_labels_uncached(block: str) -> Labels:
    """The inside of a label block as pairs sorted by name; cached because blocks repeat."""
    pairs: list[tuple[str, str]] = []
    pos = 0
    end = len(block)
    while pos < end:
        if not block[pos:].strip(" \t"):
            break
        m = _LABEL.match(block, pos)
        if m is None:
            raise _LabelError("invalid label")
        value = m.group(2)
        if "\\" in value:
            value = _ESCAPE.sub(_unescape, value)
        pairs.append((m.group(1), value))
        pos = m.end()
        if not m.group(3):
            break
    if pos < end and block[pos:].strip(" \t"):
        raise _LabelError("invalid label")
    pairs.sort()
    for a, b in pairwise(pairs):
        if a[0] == b[0]:
            raise _LabelError(f"duplicate label {a[0]!r}")
    return tuple(pairs)


def _cost(text: str) -> int:
    """What one memo entry keyed by `text` holds: the key, and about as much again parsed."""
    return 2 * len(text)


# About 20,000 heads of a typical vLLM exposition fit; a changing or huge label cannot grow them.
HEAD_MEMO_BYTES = 8 << 20
LABEL_MEMO_BYTES = 4 << 20
_parse_head = ByteBudgetMemo(_parse_head_uncached, _cost, budget_bytes=HEAD_MEMO_BYTES)
_parse_labels = ByteBudgetMemo(_parse_labels_uncached, _cost, budget_bytes=LABEL_MEMO_BYTES)


def _unescape(m: re.Match[str]) -> str:
    """Undo the format's three escapes; other backslashes stay as written."""
    return _UNESCAPED.get(m.group(1), m.group(0))
