"""One idea, one definition and one name: the shared sets and bases are written once, and a
settings model is not named like the rule that reads it."""

from __future__ import annotations

import ast
import re
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
    # Outcome, Verdict, Plan and Rollout each named four or two types once; a reader met a
    # name and had to ask which. Enums, classes and type aliases count alike.
    defined: dict[str, list[str]] = {}
    for module, text in _sources().items():
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Assign) and _is_type_alias(node.value):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            else:
                continue
            for name in names:
                defined.setdefault(name, []).append(module)
    watched = {"Outcome", "Verdict", "Plan", "Rollout"}
    twice = {name: where for name, where in defined.items() if name in watched and len(where) > 1}
    assert twice == {}


def _is_type_alias(value: ast.expr) -> bool:
    return isinstance(value, ast.Subscript) and getattr(value.value, "id", "") == "Literal"
