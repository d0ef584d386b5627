"""Lay the top-level folders out as one `kvpilot` package, as a wheel installs them.

pyproject's `package-dir` maps `agent/`, `collectors/`, ... onto `kvpilot.agent`,
`kvpilot.collectors`, ...; mypy, import-linter and the contract tests walk a package's folder
and cannot follow that mapping, so they read this layout instead. The layout is made from
`package-dir` itself: a new top-level folder needs its entry there and nowhere else.

    .venv/bin/python scripts/package_tree.py DEST           # DEST/kvpilot, folders linked
    .venv/bin/python scripts/package_tree.py DEST --copy    # DEST/kvpilot, folders copied

Links keep a layout current as the tree changes, and are rewritten in place, so two runs may
share one layout; a copy is for a caller that edits the package (a test planting an import).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "kvpilot"


class LayoutError(Exception):
    """pyproject's package-dir maps a package somewhere this layout cannot mirror."""


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """pyproject's `[tool.setuptools.package-dir]`: package name -> folder."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    mapping: dict[str, str] = pyproject["tool"]["setuptools"]["package-dir"]
    return mapping


def top_folders(mapping: Mapping[str, str]) -> dict[str, str]:
    """The namespace's direct subpackages and their folders; deeper ones must sit inside."""
    top = {
        name.removeprefix(f"{NAMESPACE}."): folder
        for name, folder in mapping.items()
        if name.count(".") == 1 and name.startswith(f"{NAMESPACE}.")
    }
    for name, folder in mapping.items():
        parts = name.split(".")
        if len(parts) <= 2:
            continue
        # A subpackage mapped outside its parent's folder would need a layout of its own.
        expected = "/".join([top.get(parts[1], "?"), *parts[2:]])
        if folder != expected:
            raise LayoutError(f"package-dir maps {name} to {folder}, not to {expected}")
    return top


def _place(source: Path, target: Path, *, copy: bool) -> None:
    if copy:
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, target)
        return
    # Link beside the target and rename over it: a run reading the layout never sees a gap.
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    staging.unlink(missing_ok=True)
    staging.symlink_to(os.path.relpath(source, target.parent))
    os.replace(staging, target)


def lay_out(dest: Path, *, copy: bool = False, root: Path = ROOT) -> Path:
    """Make `dest/kvpilot` and return it: the namespace's own files, then each top folder."""
    mapping = package_dirs(root)
    package = dest / NAMESPACE
    package.mkdir(parents=True, exist_ok=True)
    own = root / mapping[NAMESPACE]
    for source in sorted(own.glob("*.py")):
        _place(source, package / source.name, copy=copy)
    for name, folder in sorted(top_folders(mapping).items()):
        target = package / name
        if copy and target.exists():
            raise LayoutError(f"{target} exists: a copy is made into an empty folder")
        _place(root / folder, target, copy=copy)
    return package


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="the folder that receives kvpilot/")
    parser.add_argument("--copy", action="store_true", help="copy the folders, not link them")
    args = parser.parse_args(argv)
    try:
        lay_out(args.dest.resolve(), copy=args.copy)
    except (LayoutError, OSError, KeyError) as error:
        print(f"package_tree: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
