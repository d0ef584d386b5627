"""Tuning's rooms: the local and the pod tuning beside a shared, runtime-free study. The
contract that keeps the shared modules runtime-free names every module at agent/tuning's root,
so a new shared module is held to it too; and a runtime kind is told apart in composition
(agent/app/parts.py, agent/app/compose.py) alone, counted as scripts/house_figures.py counts."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
TUNING = ROOT / "agent" / "tuning"
BESIDE = {"local", "pod"}  # the runtimes' own tuning, each a subpackage


def _contract(contract_id: str) -> dict[str, Any]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
    return next(c for c in contracts if c.get("id") == contract_id)


def test_every_shared_tuning_module_is_held_runtime_free() -> None:
    modules = {p.stem for p in TUNING.glob("*.py") if p.stem != "__init__"}
    packages = {p.name for p in TUNING.iterdir() if (p / "__init__.py").is_file()} - BESIDE
    shared = {f"kvpilot.agent.tuning.{name}" for name in modules | packages}
    contract = _contract("tuning-shared-runtime-free")
    assert set(contract["source_modules"]) == shared
    assert set(contract["forbidden_modules"]) == {
        "kvpilot.agent.runtimes",
        *(f"kvpilot.agent.tuning.{name}" for name in BESIDE),
    }
    beside = _contract("tuning-local-pod")
    assert set(beside["modules"]) == {f"kvpilot.agent.tuning.{name}" for name in BESIDE}


def test_runtime_kinds_are_told_apart_in_composition_alone() -> None:
    spec = importlib.util.spec_from_file_location(
        "house_figures", ROOT / "scripts" / "house_figures.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # dataclasses look their module up while the class is made
    spec.loader.exec_module(script)
    found = script.figures(ROOT)
    dispatch = (
        found.isinstance_direct,
        found.isinstance_alias,
        found.match_case,
        found.kind_compare,
    )
    assert dispatch == (0, 0, 0, 0)
