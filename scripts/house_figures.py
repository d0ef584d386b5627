"""Print the house's figures for a kvpilot tree: how much of the disorder the design notes name is
left. Give a tree's root (default: this repository), e.g. a worktree of an older commit:

    .venv/bin/python scripts/house_figures.py [TREE]

Counting rules (production code: the .py files under agent/, collectors/, tuner/, dashboards/,
rig/; composition: agent/app/parts.py and agent/app/compose.py, where choosing a runtime kind
and handing out the whole config belong):

* dispatch on runtime kinds, outside composition, each form counted on its own row:
  - `isinstance`: a call whose class argument spells a runtime kind's class by name (alone,
    in a tuple or in an `a | b` union). A runtime kind's class is one whose name ends in
    `Runtime`, `RuntimeConfig` or `InstanceSpec` after a prefix (`LocalRuntime`,
    `PodRuntimeConfig`, `LocalInstanceSpec`; the bare protocol `Runtime` is no kind);
  - `isinstance` through a local alias: the class argument is a name that the same function
    or module binds to such classes (`tunable = A | B` and then `isinstance(x, tunable)`);
  - `match`/`case`: each `case` whose class pattern names a runtime kind's class, and each
    `case` of a `match` on a `.kind` attribute read from something named `runtime`;
  - `.kind ==`: each comparison (`==`, `!=`, `in`, `not in`) of a `.kind` attribute read from
    an expression whose text contains `runtime`.
* `AgentConfig` parameters: function and method parameters whose annotation mentions
  `AgentConfig` (bare, `| None`, `Optional[...]`, quoted), those annotated
  `Callable[..., AgentConfig]` on a row of their own; outside composition, and in it (the two
  together are all of production).
* modules at tuner/'s root: `tuner/*.py` but `__init__.py`.
* mypy relaxations: in pyproject's `[tool.mypy]` and each `[[tool.mypy.overrides]]`, every
  flag of `--strict` set to its lax value (`strict = false`, `disallow_untyped_defs = false`,
  `implicit_reexport = true`, ...) and every `ignore_errors = true`; `ignore_missing_imports`
  (third-party modules without types) is no relaxation.
* names defined twice: public (no leading `_`) top-level class names and type-alias names
  (`X: TypeAlias = ...`, or `X = ` a subscripted, `|`-joined or `NewType` type in CapWords)
  defined in two or more production modules; the names follow the table.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRODUCTION = ("agent", "collectors", "tuner", "dashboards", "rig")
COMPOSITION = frozenset({"agent/app/parts.py", "agent/app/compose.py"})
RUNTIME_KIND = re.compile(r"^\w+(Runtime|RuntimeConfig|InstanceSpec)$")
# The flags `--strict` turns on, with the value that turns each back off.
STRICT_FLAGS = {
    "strict": False,
    "warn_unused_configs": False,
    "disallow_any_generics": False,
    "disallow_subclassing_any": False,
    "disallow_untyped_calls": False,
    "disallow_untyped_defs": False,
    "disallow_incomplete_defs": False,
    "check_untyped_defs": False,
    "disallow_untyped_decorators": False,
    "warn_redundant_casts": False,
    "warn_unused_ignores": False,
    "warn_return_any": False,
    "no_implicit_reexport": False,
    "implicit_reexport": True,
    "strict_equality": False,
    "strict_bytes": False,
    "extra_checks": False,
    "ignore_errors": True,
}


@dataclass(frozen=True)
class Figures:
    """One tree's counts; `twice` names the names defined in two or more modules."""

    isinstance_direct: int
    isinstance_alias: int
    match_case: int
    kind_compare: int
    agent_config_params: int
    agent_config_callables: int
    agent_config_params_composition: int
    agent_config_callables_composition: int
    tuner_root_modules: int
    mypy_relaxations: int
    twice: tuple[str, ...]

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("runtime dispatch outside composition: isinstance", self.isinstance_direct),
            ("runtime dispatch outside composition: isinstance via alias", self.isinstance_alias),
            ("runtime dispatch outside composition: match/case", self.match_case),
            ("runtime dispatch outside composition: .kind ==", self.kind_compare),
            ("AgentConfig parameters outside composition", self.agent_config_params),
            (
                "Callable[..., AgentConfig] parameters outside composition",
                self.agent_config_callables,
            ),
            ("AgentConfig parameters in composition", self.agent_config_params_composition),
            (
                "Callable[..., AgentConfig] parameters in composition",
                self.agent_config_callables_composition,
            ),
            ("modules at tuner/'s root", self.tuner_root_modules),
            ("mypy relaxations", self.mypy_relaxations),
            ("names defined twice", len(self.twice)),
        ]


def production_modules(tree: Path) -> Iterator[tuple[str, ast.Module]]:
    """Each production module's path (relative to the tree) and its syntax tree."""
    for folder in PRODUCTION:
        for path in sorted((tree / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield str(path.relative_to(tree)), ast.parse(path.read_text(), str(path))


def _class_names(node: ast.expr) -> list[str]:
    """The class names a class argument spells: `A`, `m.A`, `(A, B)`, `A | B`."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _class_names(element)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _class_names(node.left) + _class_names(node.right)
    return []


def _names_runtime_kind(node: ast.expr) -> bool:
    return any(RUNTIME_KIND.match(name) for name in _class_names(node))


def _runtime_kind_read(node: ast.expr) -> bool:
    """`<something named runtime>.kind`."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "kind"
        and "runtime" in ast.unparse(node.value).lower()
    )


def _aliases(scope: ast.AST) -> set[str]:
    """Names bound in a scope to runtime kinds' classes (`tunable = A | B`)."""
    return {
        target.id
        for node in ast.walk(scope)
        if isinstance(node, ast.Assign) and _names_runtime_kind(node.value)
        for target in node.targets
        if isinstance(target, ast.Name) and not RUNTIME_KIND.match(target.id)
    }


def _dispatches(pattern: ast.pattern, *, on_kind: bool) -> bool:
    """A `case` that picks a runtime kind: by its class, or by value under `match x.kind`."""
    if isinstance(pattern, ast.MatchClass):
        return _names_runtime_kind(pattern.cls)
    return on_kind and isinstance(pattern, ast.MatchValue | ast.MatchOr)


def _compares_runtime_kind(node: ast.Compare) -> bool:
    equality = any(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops)
    return equality and any(_runtime_kind_read(side) for side in (node.left, *node.comparators))


def _dispatch(module: ast.Module) -> tuple[int, int, int, int]:
    aliases = _aliases(module)
    direct = alias = cases = compares = 0
    for node in ast.walk(module):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            if _names_runtime_kind(node.args[1]):
                direct += 1
            elif set(_class_names(node.args[1])) & aliases:
                alias += 1
        elif isinstance(node, ast.Match):
            on_kind = _runtime_kind_read(node.subject)
            cases += sum(1 for case in node.cases if _dispatches(case.pattern, on_kind=on_kind))
        elif isinstance(node, ast.Compare) and _compares_runtime_kind(node):
            compares += 1
    return direct, alias, cases, compares


def _agent_config_params(module: ast.Module) -> tuple[int, int]:
    plain = callables = 0
    for node in ast.walk(module):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        arguments = node.args
        every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
        every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
        for argument in every:
            if argument.annotation is None:
                continue
            text = ast.unparse(argument.annotation)
            if "AgentConfig" not in text:
                continue
            if "Callable" in text:
                callables += 1
            else:
                plain += 1
    return plain, callables


def _defined_names(module: ast.Module) -> set[str]:
    """Top-level public classes and type aliases a module defines (a private name stays home)."""
    names: set[str] = set()
    for node in module.body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and "TypeAlias" in ast.unparse(node.annotation)
        ):
            names.add(node.target.id)
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and re.match(r"^[A-Z][a-z]\w*$", node.targets[0].id)
            and _is_type_expression(node.value)
        ):
            names.add(node.targets[0].id)
    return {name for name in names if not name.startswith("_")}


def _is_type_expression(value: ast.expr) -> bool:
    if isinstance(value, ast.Subscript):
        return True
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.BitOr):
        return True
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name | ast.Attribute)
        and ast.unparse(value.func).split(".")[-1] == "NewType"
    )


def mypy_relaxations(mypy: Mapping[str, Any]) -> int:
    """Lax flags in pyproject's `[tool.mypy]` table, its overrides included."""
    sections = [mypy, *mypy.get("overrides", [])]
    return sum(
        1
        for section in sections
        for flag, lax in STRICT_FLAGS.items()
        if flag in section and section[flag] is lax
    )


def figures(tree: Path) -> Figures:
    dispatch = [0, 0, 0, 0]
    params = [0, 0]
    composed = [0, 0]
    where: defaultdict[str, set[str]] = defaultdict(set)
    for path, module in production_modules(tree):
        for name in _defined_names(module):
            where[name].add(path)
        if path in COMPOSITION:
            composed = [a + b for a, b in zip(composed, _agent_config_params(module), strict=True)]
            continue
        dispatch = [a + b for a, b in zip(dispatch, _dispatch(module), strict=True)]
        params = [a + b for a, b in zip(params, _agent_config_params(module), strict=True)]
    pyproject = tomllib.loads((tree / "pyproject.toml").read_text())
    return Figures(
        isinstance_direct=dispatch[0],
        isinstance_alias=dispatch[1],
        match_case=dispatch[2],
        kind_compare=dispatch[3],
        agent_config_params=params[0],
        agent_config_callables=params[1],
        agent_config_params_composition=composed[0],
        agent_config_callables_composition=composed[1],
        tuner_root_modules=sum(1 for p in (tree / "tuner").glob("*.py") if p.name != "__init__.py"),
        mypy_relaxations=mypy_relaxations(pyproject.get("tool", {}).get("mypy", {})),
        twice=tuple(sorted(name for name, paths in where.items() if len(paths) > 1)),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", nargs="?", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    tree: Path = args.tree
    if not (tree / "pyproject.toml").is_file():
        print(
            f"house_figures: {tree} holds no pyproject.toml: give a kvpilot tree", file=sys.stderr
        )
        return 2
    try:
        found = figures(tree)
    except (SyntaxError, OSError, tomllib.TOMLDecodeError) as error:
        print(f"house_figures: cannot read {tree}: {error}", file=sys.stderr)
        return 1
    for label, count in found.rows():
        print(f"{label:<60} {count:>4}")
    print("names defined twice: " + (", ".join(found.twice) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
