"""Every package folder is installed under the kvpilot namespace (pyproject's mapping)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("agent", "collectors", "rig", "tuner", "dashboards")


def test_every_package_folder_is_mapped() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    folders = {
        str(init.parent.relative_to(ROOT))
        for top in TOP
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    expected = {"kvpilot." + folder.replace("/", "."): folder for folder in folders}
    assert {k: v for k, v in mapping.items() if k != "kvpilot"} == expected
    assert set(setuptools["packages"]) == {"kvpilot", *expected}
