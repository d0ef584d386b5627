"""Asks Linux for permission to use AMX tiles in every Python process that imports torch.

vLLM 0.32's CPU attention runs AMX tile instructions wherever the CPU has them
(`vllm/v1/attention/backends/cpu_attn.py`, `_get_attn_isa`), but nothing in vLLM requests the
permission that Linux has required for them since 5.16 (arch_prctl ARCH_REQ_XCOMP_PERM): on
such a CPU its workers die with SIGILL on the first request. `torch.cpu._init_amx()` asks for
it; this calls it as soon as torch is imported. The rig's scripts put this folder on
PYTHONPATH for the servers they start (the tests, the demo); a process that never imports
torch is not touched, and on a CPU without AMX the call changes nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType


class _RequestAmxAfterTorch(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        # Probes (importlib.util.find_spec) ask too: the finder stays until torch is run.
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_request(module: ModuleType) -> None:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            exec_module(module)
            init_amx = getattr(importlib.import_module("torch.cpu"), "_init_amx", None)
            if init_amx is not None:
                init_amx()

        spec.loader.exec_module = exec_then_request  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _RequestAmxAfterTorch())
