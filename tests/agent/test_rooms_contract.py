"""The agent's rooms run one way (pyproject.toml's `agent-rooms` layers contract), and so do the
modules inside the Kubernetes room (`kubernetes-room`): each holds for the tree as it is, and
breaks when a module imports one above it or a sibling."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
FOLDERS = ("agent", "collectors", "rig", "tuner", "dashboards")


def _package(tmp_path: Path) -> Path:
    """The top-level folders laid out as one `kvpilot` package, as scripts/lint-imports does."""
    package = tmp_path / "kvpilot"
    package.mkdir()
    shutil.copy(ROOT / "kvpilot_ns" / "__init__.py", package)
    for folder in FOLDERS:
        shutil.copytree(
            ROOT / folder, package / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    return package


def _rooms_contract(tree: Path, contract: str = "agent-rooms") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--contract", contract],
        # Wide enough that a long import chain is reported on one line.
        env={**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "200"},
        cwd=ROOT,  # lint-imports reads the contracts from ./pyproject.toml
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_rooms_contract_holds(tmp_path: Path) -> None:
    _package(tmp_path)
    result = _rooms_contract(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_the_rooms_contract_breaks_on_an_upward_or_sideways_import(tmp_path: Path) -> None:
    package = _package(tmp_path)
    # The rules read the tick's values from below it; importing the tick itself goes up.
    (package / "agent" / "rules" / "planted_up.py").write_text(
        "from kvpilot.agent.tick import sidecar\n"
    )
    # The notifiers and the runtimes are siblings: neither imports the other.
    (package / "agent" / "notify" / "planted_sideways.py").write_text(
        "from kvpilot.agent.runtimes import base\n"
    )
    result = _rooms_contract(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 kept, 1 broken" in result.stdout
    assert "kvpilot.agent.rules.planted_up -> kvpilot.agent.tick.sidecar" in result.stdout
    assert "kvpilot.agent.notify.planted_sideways -> kvpilot.agent.runtimes.base" in result.stdout


def test_the_kubernetes_room_contract_holds(tmp_path: Path) -> None:
    _package(tmp_path)
    result = _rooms_contract(tmp_path, "kubernetes-room")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_the_kubernetes_room_contract_breaks_on_an_upward_or_sideways_import(
    tmp_path: Path,
) -> None:
    room = _package(tmp_path) / "agent" / "runtimes" / "kubernetes"
    # The fault log is the floor: it reaching the runtime goes up.
    up = "from kvpilot.agent.runtimes.kubernetes import runtime\n"
    faults = room / "faults.py"
    faults.write_text(faults.read_text() + up)
    # The Lease and the traffic split are siblings: neither imports the other.
    sideways = "from kvpilot.agent.runtimes.kubernetes import traffic\n"
    lease = room / "lease.py"
    lease.write_text(lease.read_text() + sideways)
    result = _rooms_contract(tmp_path, "kubernetes-room")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 kept, 1 broken" in result.stdout
    assert (
        "kvpilot.agent.runtimes.kubernetes.faults -> kvpilot.agent.runtimes.kubernetes.runtime"
        in result.stdout
    )
    assert (
        "kvpilot.agent.runtimes.kubernetes.lease -> kvpilot.agent.runtimes.kubernetes.traffic"
        in result.stdout
    )
