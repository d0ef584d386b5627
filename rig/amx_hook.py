"""The AMX permission hook (`amx/sitecustomize.py`) on the PYTHONPATH of a vLLM the rig starts.

On a CPU with AMX, vLLM's CPU attention dies with SIGILL unless the process asked Linux for
the tiles (`amx/sitecustomize.py` says why). Every server the rig launches gets the hook this
way, from the installed package (it ships as package data), whether it is started by the
scripts, `kvpilot rig serve` or `kvpilot demo`.
"""

from __future__ import annotations

import os
from pathlib import Path

AMX_HOOK_DIR = Path(__file__).resolve().parent / "amx"


def with_amx_hook(pythonpath: str | None) -> str:
    """`pythonpath` with the hook's folder first, once (a `sitecustomize` earlier on the path
    would hide it); the other entries keep their order."""
    hook = str(AMX_HOOK_DIR)
    rest = [entry for entry in (pythonpath or "").split(os.pathsep) if entry and entry != hook]
    return os.pathsep.join([hook, *rest])
