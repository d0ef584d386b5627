"""Which labels a PromQL expression selects, groups and joins on, checked against the labels
the series really carry.

promtool has no parser API, so this is a small recursive-descent parser of PromQL (selectors,
ranges, offsets, subqueries, functions, aggregations with `by`/`without`, binary operators
with `bool`, `on`/`ignoring` and `group_left`/`group_right`). It does not evaluate: it infers
the label names each sub-expression's series carry, starting from the label names of the
exported series, and reports every label the expression uses that cannot be there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<range>\[[^\]]*\])
    | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)(?:[smhdwy]|ms)?
        (?:\d+(?:[smhdwy]|ms))*)
    | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){},@])
    """,
    re.VERBOSE,
)
AGGREGATIONS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    }
)
_WITH_PARAMETER = frozenset(
    {"count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
)
# Binary operators by precedence, lowest first.
_LEVELS: tuple[frozenset[str], ...] = (
    frozenset({"or"}),
    frozenset({"and", "unless"}),
    frozenset({"==", "!=", ">", "<", ">=", "<="}),
    frozenset({"+", "-"}),
    frozenset({"*", "/", "%", "atan2"}),
    frozenset({"^"}),
)
_SET_OPERATORS = frozenset({"and", "or", "unless"})
_SCALAR_FUNCTIONS = frozenset({"time", "scalar", "pi"})


class PromQLSyntaxError(ValueError):
    """The expression is not PromQL this parser reads."""


@dataclass(frozen=True, slots=True)
class Problem:
    """A label used where the series cannot carry it."""

    label: str
    use: str  # "selects", "groups by", "joins on", ...
    where: str  # the metric or sub-expression it was used on
    has: tuple[str, ...]  # the labels that are there

    def __str__(self) -> str:
        return f"{self.use} {self.label!r} on {self.where}, which has only {list(self.has)}"


@dataclass(frozen=True, slots=True)
class _Value:
    labels: frozenset[str] | None  # None: unknown (any label may be there)
    where: str
    scalar: bool = False


_SCALAR = _Value(frozenset(), "a scalar", scalar=True)


def tokens(expr: str) -> list[tuple[str, str]]:
    """(kind, text) pairs; spaces dropped."""
    out, at = [], 0
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if match is None:
            raise PromQLSyntaxError(f"cannot read {expr[at : at + 20]!r} in {expr!r}")
        kind = match.lastgroup or ""
        if kind != "space":
            out.append((kind, match.group()))
        at = match.end()
    return out


class _Parser:
    def __init__(self, expr: str, known: Mapping[str, frozenset[str] | None]) -> None:
        self.expr = expr
        self.tokens = tokens(expr)
        self.at = 0
        self.known = known
        self.problems: list[Problem] = []

    # Tokens.
    def peek(self, ahead: int = 0) -> tuple[str, str]:
        index = self.at + ahead
        return self.tokens[index] if index < len(self.tokens) else ("end", "")

    def take(self, text: str | None = None) -> str:
        kind, value = self.peek()
        if kind == "end" or (text is not None and value != text):
            raise PromQLSyntaxError(
                f"expected {text or 'more'} at token {self.at} of {self.expr!r}"
            )
        self.at += 1
        return value

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        names: list[str] = []
        while self.peek()[1] != ")":
            names.append(self.take())
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return tuple(names)

    # Checks.
    def need(self, value: _Value, labels: tuple[str, ...], use: str) -> None:
        if value.labels is None or value.scalar:
            return
        for label in labels:
            if label not in value.labels:
                self.problems.append(Problem(label, use, value.where, tuple(sorted(value.labels))))

    # Grammar.
    def parse(self) -> _Value:
        value = self.binary(0)
        if self.peek()[0] != "end":
            raise PromQLSyntaxError(f"unexpected {self.peek()[1]!r} in {self.expr!r}")
        return value

    def binary(self, level: int) -> _Value:
        if level == len(_LEVELS):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek()[1] in _LEVELS[level]:
            op = self.take()
            if self.peek()[1] == "bool":
                self.take()
            on: tuple[str, ...] | None = None
            ignoring: tuple[str, ...] = ()
            if self.peek()[1] == "on":
                self.take()
                on = self.label_list()
            elif self.peek()[1] == "ignoring":
                self.take()
                ignoring = self.label_list()
            group, extra = "", ()
            if self.peek()[1] in ("group_left", "group_right"):
                group = self.take()
                if self.peek()[1] == "(":
                    extra = self.label_list()
            # `^` is right-associative; the others left.
            right = self.binary(level if op == "^" else level + 1)
            left = self.combine(op, left, right, on, ignoring, group, extra)
        return left

    def combine(
        self,
        op: str,
        left: _Value,
        right: _Value,
        on: tuple[str, ...] | None,
        ignoring: tuple[str, ...],
        group: str,
        extra: tuple[str, ...],
    ) -> _Value:
        if left.scalar or right.scalar:
            return right if left.scalar else left
        where = f"({left.where} {op} {right.where})"
        if on is not None:
            self.need(left, on, "joins on")
            self.need(right, on, "joins on")
        else:
            self.need(left, ignoring, "ignores")
            self.need(right, ignoring, "ignores")
            if op not in _SET_OPERATORS and not group and None not in (left.labels, right.labels):
                # Matching on every label: a label on one side only means nothing matches.
                assert left.labels is not None and right.labels is not None
                for side, other in ((left, right), (right, left)):
                    assert side.labels is not None and other.labels is not None
                    missing = tuple(sorted(side.labels - other.labels - set(ignoring)))
                    self.need(other, missing, "matches on")
        if group == "group_left":
            self.need(right, extra, "copies")
            base = left
        elif group == "group_right":
            self.need(left, extra, "copies")
            base = right
        else:
            base = left
        if op == "or":
            if left.labels is None or right.labels is None:
                return _Value(None, where)
            return _Value(left.labels | right.labels, where)
        if base.labels is None:
            return _Value(None, where)
        return _Value(base.labels | set(extra), where)

    def unary(self) -> _Value:
        if self.peek()[1] in ("-", "+"):
            self.take()
            return self.unary()
        return self.postfix(self.primary())

    def postfix(self, value: _Value) -> _Value:
        while True:
            kind, text = self.peek()
            if kind == "range":
                self.take()
            elif text in ("offset", "@"):
                self.take()
                if self.peek()[1] in ("-", "+"):
                    self.take()
                self.take()
                if self.peek()[1] == "(":  # `@ start()`
                    self.take("(")
                    self.take(")")
            else:
                return value

    def primary(self) -> _Value:
        kind, text = self.peek()
        if kind in ("number", "string"):
            self.take()
            return _SCALAR
        if text == "(":
            self.take("(")
            value = self.binary(0)
            self.take(")")
            return value
        if text == "{":
            return self.selector(None)
        if kind != "ident":
            raise PromQLSyntaxError(f"unexpected {text!r} in {self.expr!r}")
        nxt = self.peek(1)[1]
        if text in AGGREGATIONS and nxt in ("(", "by", "without"):
            return self.aggregation()
        if nxt == "(":
            return self.function()
        if text in ("Inf", "NaN", "inf", "nan"):
            self.take()
            return _SCALAR
        return self.selector(self.take())

    def selector(self, name: str | None) -> _Value:
        matchers: list[tuple[str, str, str]] = []
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label = self.take()
                op = self.take()
                value = self.take()
                matchers.append((label, op, value))
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        if name is None:
            named = [v for label, op, v in matchers if label == "__name__" and op == "="]
            name = named[0][1:-1] if named else None
        if name is None:
            return _Value(None, "a selector without a metric name")
        if name not in self.known:
            self.problems.append(Problem("__name__", "reads", name, ("(not exported)",)))
            return _Value(None, name)
        value = _Value(self.known[name], name)
        self.need(value, tuple(m[0] for m in matchers if m[0] != "__name__"), "selects")
        return value

    def aggregation(self) -> _Value:
        op = self.take()
        clause, names = "", ()
        if self.peek()[1] in ("by", "without"):
            clause = self.take()
            names = self.label_list()
        self.take("(")
        parameter = None
        if op in _WITH_PARAMETER:
            parameter = self.binary(0)
            self.take(",")
        inner = self.binary(0)
        self.take(")")
        if self.peek()[1] in ("by", "without"):
            clause = self.take()
            names = self.label_list()
        del parameter
        self.need(inner, names, "groups by" if clause == "by" else "drops")
        if clause == "by":
            return _Value(frozenset(names), f"{op} by ({', '.join(names)})")
        if clause == "without":
            labels = None if inner.labels is None else inner.labels - set(names)
            return _Value(labels, f"{op} without ({', '.join(names)}) of {inner.where}")
        return _Value(frozenset(), f"{op}(...)")

    def function(self) -> _Value:
        name = self.take()
        self.take("(")
        args: list[_Value] = []
        raw: list[str] = []
        while self.peek()[1] != ")":
            raw.append(self.peek()[1])
            args.append(self.binary(0))
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        if name in _SCALAR_FUNCTIONS:
            return _SCALAR
        if name == "vector":
            return _Value(frozenset(), "vector(...)")
        if name in ("absent", "absent_over_time"):
            return _Value(frozenset(), f"{name}(...)")  # only its equality matchers' labels
        if name == "histogram_quantile":
            self.need(args[1], ("le",), "reads buckets by")
            labels = None if args[1].labels is None else args[1].labels - {"le"}
            return _Value(labels, f"histogram_quantile of {args[1].where}")
        if name in ("label_replace", "label_join"):
            vector = args[0]
            # label_replace(v, dst, replacement, src, regex); label_join(v, dst, sep, src...)
            sources = raw[3:4] if name == "label_replace" else raw[3:]
            self.need(vector, tuple(s.strip("\"'`") for s in sources if s.strip("\"'`")), "copies")
            target = raw[1].strip("\"'`")
            labels = None if vector.labels is None else vector.labels | {target}
            return _Value(labels, vector.where)
        vectors = [a for a in args if not a.scalar]
        return vectors[0] if vectors else _SCALAR


def check(expr: str, known: Mapping[str, frozenset[str] | None]) -> list[Problem]:
    """The labels `expr` uses that the series named in `known` cannot carry."""
    parser = _Parser(expr, known)
    parser.parse()
    return parser.problems


def result_labels(expr: str, known: Mapping[str, frozenset[str] | None]) -> frozenset[str] | None:
    """The label names the result of `expr` carries (None: unknown)."""
    return _Parser(expr, known).parse().labels
