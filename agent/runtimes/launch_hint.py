"""What to change when a server could not start: a program not found, a Python without vLLM.

Both are first-run mistakes (the example's `python -m vllm...` run outside the virtualenv
that has vLLM): the hint names the interpreter that ran and the setting to change.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Sequence

# "No module named 'vllm'" (python -m) or "No module named 'vllm.entrypoints'" and the like.
_NO_VLLM = re.compile(r"No module named '?vllm\b")
# `python -m` names the interpreter that ran first: "/usr/bin/python3: Error while finding ..."
_RAN = re.compile(r"^(\S+): Error while finding module specification for 'vllm", re.MULTILINE)
_EXAMPLE = ".venv/bin/python"


def resolve(program: str, path: str | None) -> str | None:
    """Where `program` is found as the child would find it (its PATH), or None."""
    return shutil.which(program, path=path)


def no_vllm_hint(argv: Sequence[str], path: str | None, log_tail: str | None) -> str | None:
    """When the server's log says its Python has no vLLM: which interpreter ran, what to set."""
    if not argv or not log_tail or not _NO_VLLM.search(log_tail):
        return None
    program = argv[0]
    resolved = resolve(program, path) or program
    ran = _RAN.search(log_tail)
    via = f" (which ran {ran.group(1)})" if ran and ran.group(1) != resolved else ""
    return (
        f"the argv's {program!r} resolved to {resolved}{via}, which has no vllm; "
        f"use the virtualenv's python in `argv`, e.g. {_suggestion(resolved)}"
    )


def not_found_hint(program: str, path: str | None) -> str:
    """For a program that could not be executed at all."""
    if os.sep in program:
        return f"{program!r} does not exist or cannot be executed; fix the path in `argv`"
    return (
        f"{program!r} is not on the server's PATH; give its full path in `argv`, "
        f"e.g. {_suggestion(None)}"
    )


def _suggestion(avoid: str | None) -> str:
    """kvpilot's own interpreter when it has vLLM (the usual install), else the usual path."""
    own = sys.executable
    if own and own != avoid and importlib.util.find_spec("vllm") is not None:
        return f"{own} (kvpilot's own, which has vllm)"
    return f"{_EXAMPLE} of the virtualenv where vLLM is installed"
