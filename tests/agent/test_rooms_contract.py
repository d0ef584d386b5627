"""Every import-linter contract in pyproject.toml holds for the tree as it is, and breaks when an
import that violates it is planted: the contracts are read from pyproject, so a new contract is
covered without an edit here. One lint-imports run checks them all on the package as
scripts/package_tree.py lays it out; a second run checks them all with every plant at once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONTRACTS: list[dict[str, Any]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "importlinter"
]["contracts"]


@dataclass(frozen=True)
class Plant:
    """An import of `imported` written into `importer` (a package gets a new module)."""

    importer: str
    imported: str


def _siblings(layer: str) -> list[str]:
    # import-linter writes independent siblings as "a | b" and optional layers as "(a)".
    return [name.strip().strip("()") for name in layer.split("|")]


def _plants(contract: Mapping[str, Any]) -> list[Plant]:
    """Imports that break the contract: the lowest layer reaching the top, one sibling another,
    a source module reaching a forbidden one, one independent module another."""
    kind = contract["type"]
    if kind == "layers":
        layers = [_siblings(layer) for layer in contract["layers"]]
        plants = [Plant(layers[-1][0], layers[0][0])]
        plants += [Plant(group[0], group[1]) for group in layers if len(group) > 1]
        containers = contract.get("containers", [])
        return [
            Plant(f"{container}.{p.importer}", f"{container}.{p.imported}")
            for container in containers
            for p in plants
        ] or plants
    if kind == "forbidden":
        return [Plant(contract["source_modules"][0], contract["forbidden_modules"][0])]
    if kind == "independence":
        first, second = contract["modules"][:2]
        return [Plant(first, second)]
    raise AssertionError(f"no plant known for a {kind!r} contract: teach _plants one")


def _path(package: Path, module: str) -> Path:
    return package.joinpath(*module.split(".")[1:])


def _plant(package: Path, plant: Plant, number: int) -> str:
    """Write the import and return the importing module's name as import-linter reports it."""
    line = f"import {plant.imported}\n"
    folder = _path(package, plant.importer)
    if folder.is_dir():
        (folder / f"planted_{number}.py").write_text(line)
        return f"{plant.importer}.planted_{number}"
    module = folder.with_suffix(".py")
    assert module.is_file(), f"{plant.importer} is neither a package nor a module"
    # A copy (never a link into the tree): appending leaves the repository's file alone.
    assert not module.is_symlink()
    module.write_text(module.read_text() + line)
    return plant.importer


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        # Wide enough that a contract's name and an import chain each stay on one line.
        env={**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "500"},
        cwd=ROOT,  # lint-imports reads the contracts from ./pyproject.toml
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _broken_sections(report: str) -> dict[str, str]:
    """Each broken contract's name and the text import-linter prints under it."""
    _, _, details = report.partition("Broken contracts")
    # Each section opens with the contract's name underlined by dashes.
    heads = list(re.finditer(r"^(.+)\n-+\n", details, flags=re.MULTILINE))
    ends = [h.start() for h in heads[1:]] + [len(details)]
    return {h.group(1).strip(): details[h.end() : end] for h, end in zip(heads, ends, strict=True)}


def _package(tree: Path, *how: str) -> Path:
    """The package as scripts/package_tree.py lays it out for the tools (`--copy` to plant)."""
    command = [sys.executable, str(ROOT / "scripts" / "package_tree.py"), str(tree), *how]
    subprocess.run(command, check=True, timeout=60)
    return tree / "kvpilot"


def _room_plants() -> list[Plant]:
    """A new module in each room a forbidden contract names with `.**`, importing what the
    room may import: the room is what is allowed, not the modules in it today."""
    plants = []
    for contract in CONTRACTS:
        for ignored in (
            contract.get("ignore_imports", []) if contract["type"] == "forbidden" else []
        ):
            importer, _, imported = (part.strip() for part in ignored.partition("->"))
            if importer.endswith(".**") and "*" not in imported:
                plants.append(Plant(importer.removesuffix(".**"), imported))
    return plants


def test_every_contract_holds_with_a_new_client_module_in_each_room(tmp_path: Path) -> None:
    package = _package(tmp_path, "--copy")
    plants = _room_plants()
    assert plants, "no contract names a room"
    for number, plant in enumerate(plants):
        _plant(package, plant, number)
    result = _lint_imports(package.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(CONTRACTS)} kept, 0 broken" in result.stdout


def test_every_contract_breaks_on_its_planted_import(tmp_path: Path) -> None:
    package = _package(tmp_path, "--copy")
    planted: list[tuple[str, Sequence[str]]] = []
    number = 0
    for contract in CONTRACTS:
        imports = []
        for plant in _plants(contract):
            number += 1
            importer = _plant(package, plant, number)
            imports.append(f"{importer} -> {plant.imported}")
        planted.append((contract["name"], imports))
    result = _lint_imports(package.parent)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"0 kept, {len(CONTRACTS)} broken" in result.stdout, result.stdout
    sections = _broken_sections(result.stdout)
    for name, imports in planted:
        # Each contract is broken by its own plant, not only by another contract's.
        for line in imports:
            assert f"{line} (l." in sections[name], f"{name}: {line} not reported\n{sections[name]}"
