"""The planner stays importable in the small core install."""

from __future__ import annotations

import subprocess
import sys


def test_import_pulls_in_no_scientific_stack() -> None:
    code = (
        "import sys, kvpilot.tuner.planner, kvpilot.tuner.planner.render\n"
        "heavy = [m for m in ('numpy', 'scipy', 'skopt', 'torch', 'vllm') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
