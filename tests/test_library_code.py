"""Library code leaves the command line to the CLI: it imports no CLI module and sets no
logger's level (the CLI configures logging once, through `agent/app/logs.py`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("agent", "collectors", "rig", "tuner", "dashboards")
# The CLI itself, its `python -m` entry, and the logging set-up the CLI calls.
NOT_LIBRARY = ("agent/cli/", "agent/__main__.py", "agent/app/logs.py")
CLI = "kvpilot.agent.cli"


def _offences(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(CLI):
            found.append(f"imports {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"imports {a.name}" for a in node.names if a.name.startswith(CLI)]
        elif isinstance(node, ast.Attribute) and node.attr in ("setLevel", "disable"):
            found.append(f"calls {node.attr}")
    return found


def test_library_code_imports_no_cli_and_sets_no_log_level() -> None:
    files = [path for top in TOP for path in sorted((ROOT / top).rglob("*.py"))]
    library = [p for p in files if not str(p.relative_to(ROOT)).startswith(NOT_LIBRARY)]
    assert len(library) > 100  # the walk sees the code
    offences = [f"{p.relative_to(ROOT)}: {o}" for p in library for o in _offences(p.read_text())]
    assert offences == []


def test_the_check_sees_both_offences() -> None:
    source = (
        "import logging\nfrom kvpilot.agent.cli.plan_cmd import gpu_from_nvml\n"
        "import kvpilot.agent.cli.main\nlogging.getLogger('x').setLevel(logging.ERROR)\n"
    )
    assert sorted(_offences(source)) == [
        "calls setLevel",
        "imports kvpilot.agent.cli.main",
        "imports kvpilot.agent.cli.plan_cmd",
    ]
