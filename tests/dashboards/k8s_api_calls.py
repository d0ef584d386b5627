"""Every Kubernetes API call the agent can make, read from its source (no import, no run).

The runtime makes each call through `call(fn, ..., verb=..., resource=...)`
(agent/runtimes/kubernetes/api.py), directly or as `asyncio.to_thread(call, fn, ...)`. This module
walks the syntax tree of every module under agent/, finds those call sites and resolves
their verb and resource to strings: literals, module constants (also imported ones), and a
function's parameter through every call of that function in its module. A value it cannot
resolve is an error, so a call site cannot hide from the RBAC test by being dynamic. It
also finds every client method (`read_namespaced_pod`, ...) used outside `call(...)`, and
checks that the declared verb and resource are those of the method called.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "agent"
# The client's API methods: verb, optional scope, then the kind in snake case.
METHOD = re.compile(
    r"^(read|get|list|create|patch|replace|delete|watch)_(namespaced_|cluster_)?([a-z_]+?)"
    r"(_for_all_namespaces)?$"
)
METHOD_VERB = {
    "read": "get",
    "get": "get",  # CustomObjectsApi
    "list": "list",
    "create": "create",
    "patch": "patch",
    "replace": "update",
    "delete": "delete",
    "watch": "watch",
}
# A client method named anywhere: namespaced, across namespaces, or a custom object's.
CLIENT_METHOD = re.compile(
    r"^(read|get|list|create|patch|replace|delete|watch)_"
    r"(namespaced_\w+|\w+_for_all_namespaces|cluster_custom_object\w*)$"
)


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One call site, with one of the verbs it can use on its resource."""

    verb: str
    resource: str  # as the runtime names it: `deployments.apps`, `pods`
    method: str  # the client method, e.g. `patch_namespaced_deployment`
    where: str  # path:line

    @property
    def group(self) -> str:
        return self.resource.partition(".")[2]

    @property
    def plural(self) -> str:
        return self.resource.partition(".")[0]


class Unresolvable(Exception):
    """A verb or resource the reader cannot pin to a string."""


def modules() -> list[Path]:
    return sorted(p for p in AGENT.rglob("*.py") if "__pycache__" not in p.parts)


def _module_path(dotted: str) -> Path | None:
    parts = dotted.split(".")
    if parts[0] != "kvpilot" or len(parts) < 2:
        return None
    path = ROOT.joinpath(*parts[1:]).with_suffix(".py")
    return path if path.is_file() else None


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@cache
def _constants(path: Path) -> dict[str, ast.expr]:
    """Module-level `NAME = value` assignments."""
    out: dict[str, ast.expr] = {}
    for node in _tree(path).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                out[target.id] = node.value
            elif (
                isinstance(target, ast.Tuple)
                and isinstance(node.value, ast.Tuple)
                and len(target.elts) == len(node.value.elts)
            ):  # A, B = "a", "b"
                for name, value in zip(target.elts, node.value.elts, strict=True):
                    if isinstance(name, ast.Name):
                        out[name.id] = value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            out[node.target.id] = node.value
    return out


@cache
def _imports(path: Path) -> tuple[dict[str, tuple[Path, str]], dict[str, Path]]:
    """(names imported from kvpilot modules -> (module, name), module aliases -> module)."""
    names: dict[str, tuple[Path, str]] = {}
    aliases: dict[str, Path] = {}
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                source = _module_path(f"{node.module}.{alias.name}")
                if source is not None:  # `from package import module`
                    aliases[alias.asname or alias.name] = source
                    continue
                source = _module_path(node.module)
                if source is not None:
                    names[alias.asname or alias.name] = (source, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                source = _module_path(alias.name)
                if source is not None and alias.asname:
                    aliases[alias.asname] = source
    return names, aliases


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [
        n for n in ast.walk(_tree(path)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def _enclosing(path: Path, node: ast.expr) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The innermost function around `node`."""
    best = None
    for fn in _functions(path):
        end = fn.end_lineno or fn.lineno
        if fn.lineno <= node.lineno <= end and (best is None or fn.lineno >= best.lineno):
            best = fn
    return best


def _callee_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _argument(
    call: ast.Call, fn: ast.FunctionDef | ast.AsyncFunctionDef, name: str
) -> ast.expr | None:
    """The expression a call passes for parameter `name` of `fn`, or its default."""
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    positional = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    if positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    if name in positional and positional.index(name) < len(call.args):
        return call.args[positional.index(name)]
    kwonly = [a.arg for a in fn.args.kwonlyargs]
    if name in kwonly:
        default = fn.args.kw_defaults[kwonly.index(name)]
        if default is not None:
            return default
    return None


def resolve(path: Path, expr: ast.expr, seen: frozenset[str] = frozenset()) -> set[str]:
    """Every string `expr` can be at its place in `path`."""
    where = f"{_rel(path)}:{expr.lineno}"
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return {expr.value}
    if isinstance(expr, ast.JoinedStr):  # f"{PLURAL}.{GROUP}": every combination
        texts = {""}
        for part in expr.values:
            if isinstance(part, ast.FormattedValue):
                if part.format_spec is not None or part.conversion != -1:
                    break
                values = resolve(path, part.value, seen)
            else:
                values = resolve(path, part, seen)
            texts = {a + b for a in texts for b in values}
        else:
            return texts
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        module = _imports(path)[1].get(expr.value.id)
        if module is not None and expr.attr in _constants(module):
            return resolve(module, _constants(module)[expr.attr], seen)
    if isinstance(expr, ast.Name):
        if expr.id in _constants(path):
            return resolve(path, _constants(path)[expr.id], seen)
        imported = _imports(path)[0].get(expr.id)
        if imported is not None and imported[1] in _constants(imported[0]):
            return resolve(imported[0], _constants(imported[0])[imported[1]], seen)
        fn = _enclosing(path, expr)
        params = [] if fn is None else [a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)]
        if fn is not None and expr.id in params:
            key = f"{path}:{fn.name}:{expr.id}"
            if key in seen:
                return set()
            values: set[str] = set()
            sites = [
                c
                for c in ast.walk(_tree(path))
                if isinstance(c, ast.Call) and _callee_name(c) == fn.name
            ]
            for site in sites:
                passed = _argument(site, fn, expr.id)
                if passed is None:
                    raise Unresolvable(f"{where}: {fn.name}() called without {expr.id!r}")
                values |= resolve(path, passed, seen | {key})
            if not values:
                raise Unresolvable(f"{where}: {fn.name}() is never called; {expr.id!r} unknown")
            return values
    raise Unresolvable(f"{where}: cannot read {ast.unparse(expr)!r} as a string")


def _api_method(call: ast.Call) -> ast.Attribute | None:
    """The client method a `call(...)` site calls: the first argument that names one."""
    for arg in call.args:
        if isinstance(arg, ast.Attribute) and METHOD.match(arg.attr):
            return arg
    return None


def _custom_object_check(
    path: Path, node: ast.Call, method: ast.Attribute, declared: set[str]
) -> list[str]:
    """A custom object's group and plural are arguments (group, version, namespace, plural,
    ...): they must be the declared resource's."""
    keywords = {k.arg: k.value for k in node.keywords if k.arg}
    at = next(i for i, arg in enumerate(node.args) if arg is method)
    rest = node.args[at + 1 :]
    group = keywords.get("group", rest[0] if rest else None)
    plural = keywords.get("plural", rest[3] if len(rest) > 3 else None)
    where = f"{_rel(path)}:{node.lineno}"
    if group is None or plural is None:
        return [f"{where}: {method.attr} without its group and plural"]
    called = {f"{p}.{g}" for g in resolve(path, group) for p in resolve(path, plural)}
    if called != declared:
        return [f"{where}: {method.attr} acts on {sorted(called)}, declared {sorted(declared)}"]
    return []


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def collect(paths: list[Path] | None = None) -> tuple[list[ApiCall], list[str]]:
    """(every call with each verb it can use, every problem found on the way)."""
    calls: list[ApiCall] = []
    problems: list[str] = []
    for path in modules() if paths is None else paths:
        wrapped: set[int] = set()
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Call):
                continue
            keywords = {k.arg: k.value for k in node.keywords if k.arg}
            if "verb" not in keywords or "resource" not in keywords:
                continue
            method = _api_method(node)
            if method is None:
                continue  # not an API call (an error built from a verb); a method taken
                # elsewhere and passed in is reported below as used outside call(...)
            wrapped.add(id(method))
            try:
                verbs = resolve(path, keywords["verb"])
                resources = resolve(path, keywords["resource"])
                if "custom_object" in method.attr:
                    problems += _custom_object_check(path, node, method, resources)
            except Unresolvable as exc:
                problems.append(str(exc))
                continue
            for verb in sorted(verbs):
                for resource in sorted(resources):
                    where = f"{_rel(path)}:{node.lineno}"
                    calls.append(ApiCall(verb, resource, method.attr, where))
        for node in ast.walk(_tree(path)):
            if (
                isinstance(node, ast.Attribute)
                and CLIENT_METHOD.match(node.attr)
                and id(node) not in wrapped
            ):
                problems.append(
                    f"{_rel(path)}:{node.lineno}: {ast.unparse(node)} is called "
                    "outside call(..., verb=..., resource=...)"
                )
    return calls, problems


def mismatch(api_call: ApiCall) -> str | None:
    """Why the declared verb or resource is not the method's, or None when they agree."""
    match = METHOD.match(api_call.method)
    assert match is not None
    verb = METHOD_VERB[match.group(1)]
    if api_call.method.startswith("list_") and api_call.verb == "watch":
        verb = "watch"  # list with watch=True
    if verb != api_call.verb:
        return f"{api_call.where}: {api_call.method} is '{verb}', declared '{api_call.verb}'"
    kind = match.group(3)
    if kind.endswith("custom_object"):
        return None  # the plural is an argument; the declared resource is taken as given
    plural = kind.replace("_", "")
    plural = plural if plural.endswith("s") else plural + "s"
    if plural != api_call.plural:
        return (
            f"{api_call.where}: {api_call.method} acts on '{plural}', declared "
            f"'{api_call.resource}'"
        )
    return None
