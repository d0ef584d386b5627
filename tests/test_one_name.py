"""One idea, one definition and one name: the shared sets and bases are written once, and a
settings model is not named like the rule that reads it."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = ("agent", "collectors", "tuner", "dashboards", "rig")


def _sources() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for folder in PRODUCTION
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def test_the_wildcard_hosts_are_written_once() -> None:
    spelled = re.compile(r"frozenset\(\{[^}]*\"0\.0\.0\.0\"")
    where = sorted(name for name, text in _sources().items() if spelled.search(text))
    assert where == ["collectors/addresses.py"]


def test_the_strict_frozen_base_is_written_once() -> None:
    spelled = re.compile(r"ConfigDict\(extra=\"forbid\", frozen=True\)")
    where = sorted(name for name, text in _sources().items() if spelled.search(text))
    assert where == ["agent/strict_model.py"]


def test_settings_models_are_not_named_like_the_rules() -> None:
    tree = ast.parse((ROOT / "agent/rules/config.py").read_text())
    models = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    public = [name for name in models if not name.startswith("_")]
    assert public and all(name.endswith("Config") for name in public), public


def test_no_two_modules_give_one_top_level_name_to_two_types() -> None:
    """A reader who meets a type's name finds one definition of it in production code.

    Watched: every public top-level class, and every public type alias: `X: TypeAlias = ...`,
    `type X = ...`, a CapWords name given a subscripted type (`Literal[...]`, `tuple[...]`,
    `Annotated[...]`), a `|` union, another class's name, or a `NewType`, `NamedTuple` or
    `TypedDict` call. A `TypeVar` is no type of its own and a private name (leading `_`) stays
    in its module, so neither counts. Where two modules meant one type, one defines it and
    the other imports it (`Labels`, `EngineKey`, `Item`); where they meant two, each has its
    own name (`TickStep`, `LadderStep`, `KnobStep`).
    """
    defined = _defined_types(ROOT)
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert twice == {}


def test_the_watch_sees_every_shape_a_type_is_defined_in() -> None:
    module = ast.parse(
        "from typing import TYPE_CHECKING, NewType, TypeAlias, TypeVar\n"
        "class Plain: ...\n"
        "Picked = Literal['a', 'b']\n"
        "Either = int | str\n"
        "Spelled: TypeAlias = 'dict[str, int]'\n"
        "Unique = NewType('Unique', str)\n"
        "Other = Plain\n"
        "if TYPE_CHECKING:\n"
        "    Guarded = tuple[int, ...]\n"
        "T = TypeVar('T')\n"
        "LIMIT = SIZES[0]\n"
        "_Hidden = list[int]\n"
        "class _Private: ...\n"
    )
    assert _types_in(module) == {
        "Plain",
        "Picked",
        "Either",
        "Spelled",
        "Unique",
        "Other",
        "Guarded",
    }


# A shared module name is deliberate: written here with what its modules have in common, the
# same role in each room or one subject seen from each room.
SHARED_MODULE_NAMES = {
    "base": "a room's interface and what its members share",
    "errors": "a room's errors",
    "checks": "what a room checks before it trusts a value or takes a step",
    "record": "what a room keeps of its subject: the replayed workload, a rollout's journal",
    "adapter": "the tuner's runtime over one runtime kind (tuning.local, tuning.pod)",
    "tuner": "tuning on one runtime kind (tuning.local, tuning.pod)",
    "api": "an HTTP API: the one the agent serves, the one the Kubernetes runtime calls",
    "window": "a window over the scrapes: the collectors' rolling one, the served workload's",
    "tuning": "tuning: its config section, its dashboard",
    "runtime": "a runtime: its config section, the Kubernetes runtime",
    "trials": "tuning trials: the record, its table in the state database",
    "preflight": "the memory pre-flight: the planner's for one value, remediation's on a restart",
    "calibration": "the planner against the live server: the comparison, the tick's reading",
    "fragmentation": "fragmentation: the formula, the rule on it",
    "occupancy": "token occupancy: the figure, the rule on it",
    "evidence": "the judge's evidence: its tests, the report's words on them",
    "exposition": "kvpilot's /metrics: its config section, the rendering",
    "settings": "what a loop runs under, as one value: the tick's, a rollout's",
}
# Shared names of which one module means another thing, each still to be renamed.
NOT_YET_RENAMED = {
    "server": "collectors/kvpool/server.py is the plugin's HTTP exposition, not a vLLM server",
}
# Names that meant two or three things (a delivery report, the CLI's snapshot view and the
# tuning report; the loop's control interfaces, the tuner's ports and the plugin's listen
# address): each is held by one module or package now.
ONE_MODULE = ("report", "ports")


def test_a_module_name_that_meant_several_things_names_one_module() -> None:
    where = _module_names(ROOT, packages=True)
    assert {name: where[name] for name in ONE_MODULE if len(where[name]) > 1} == {}


def test_module_names_are_shared_only_where_their_modules_share_a_meaning() -> None:
    """Module files (`__init__` and `__main__` aside) are named for what they hold, read with
    their folder. Rooms name their modules by subject (config sections, dashboards, rules after
    what they watch), so a subject may recur across rooms, and a role (`base`, `errors`) in
    each room; whether two modules mean one thing is a reader's judgement, not a machine's,
    so every shared name is written in `SHARED_MODULE_NAMES` with what its modules share, and
    a new one fails here until someone does the same or renames it. Packages are rooms, named
    by the import contracts, and are not counted. A name written down and no longer shared
    fails too, so the table stays the tree's."""
    where = _module_names(ROOT, packages=False)
    shared = {name for name, paths in where.items() if len(paths) > 1}
    written = set(SHARED_MODULE_NAMES) | set(NOT_YET_RENAMED)
    assert {name: where[name] for name in shared - written} == {}
    assert written - shared == set()


def _module_names(root: Path, *, packages: bool) -> dict[str, list[str]]:
    """Each production module's name (its file's stem; with `packages`, each subpackage's
    folder too) and where it is."""
    where: defaultdict[str, list[str]] = defaultdict(list)
    for folder in PRODUCTION:
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            relative = str(path.relative_to(root))
            if path.stem not in ("__init__", "__main__"):
                where[path.stem].append(relative)
            elif path.name == "__init__.py" and packages and path.parent != root / folder:
                where[path.parent.name].append(str(path.parent.relative_to(root)) + "/")
    return where


def _defined_types(root: Path) -> dict[str, list[str]]:
    """Each public top-level type's name and the production modules that define it."""
    defined: defaultdict[str, list[str]] = defaultdict(list)
    for folder in PRODUCTION:
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            module = ast.parse(path.read_text(), str(path))
            for name in sorted(_types_in(module)):
                defined[name].append(str(path.relative_to(root)))
    return defined


_CAP_WORDS = re.compile(r"[A-Z][a-z0-9]\w*")  # a type's spelling; constants are UPPER_CASE
_TYPE_FACTORIES = frozenset({"NewType", "NamedTuple", "TypedDict"})
# `type X = ...` (Python 3.12); an empty tuple where the syntax does not exist.
_TYPE_STATEMENT = getattr(ast, "TypeAlias", ())


def _types_in(module: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in _top_level(module.body):
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, _TYPE_STATEMENT):
            names.add(node.name.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _last_name(node.annotation) == "TypeAlias":
                names.add(node.target.id)
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and _CAP_WORDS.fullmatch(node.targets[0].id)
            and _is_type_expression(node.value)
        ):
            names.add(node.targets[0].id)
    return {name for name in names if not name.startswith("_")}


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's own statements, those under a top-level `if` or `try` included."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level([*node.body, *node.orelse])
        elif isinstance(node, ast.Try):
            handlers = [statement for handler in node.handlers for statement in handler.body]
            yield from _top_level([*node.body, *handlers, *node.orelse, *node.finalbody])


def _is_type_expression(value: ast.expr) -> bool:
    if isinstance(value, ast.Subscript):
        return True
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.BitOr):
        return True
    if isinstance(value, ast.Name | ast.Attribute):  # another class's name
        return bool(_CAP_WORDS.fullmatch(_last_name(value)))
    return isinstance(value, ast.Call) and _last_name(value.func) in _TYPE_FACTORIES


def _last_name(node: ast.expr) -> str:
    """`X` of `X`, `typing.X` or `"X"`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.rsplit(".", 1)[-1]
    return ""
