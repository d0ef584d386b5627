"""Test support, a fake: puts the fake NVML library into a `kvpilot run` started by a test.

Python imports `sitecustomize` at start-up from `sys.path`; a test puts this folder on the
child's `PYTHONPATH` and sets `KVPILOT_FAKE_NVML` to a JSON description of the GPUs. Without
that variable nothing happens. Production code never reads it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_DESCRIPTION = os.environ.get("KVPILOT_FAKE_NVML")

if _DESCRIPTION:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from tests.fakes.nvml import FakeGpu, FakeNvmlLibrary, FakeProcess, install

    _gpus = [
        FakeGpu(
            uuid=gpu["uuid"],
            total_bytes=gpu["total_bytes"],
            used_bytes=gpu["used_bytes"],
            reserved_bytes=gpu["reserved_bytes"],
            utilization_gpu_percent=gpu["utilization_gpu_percent"],
            utilization_memory_percent=gpu["utilization_memory_percent"],
            processes=tuple(
                FakeProcess(pid=p["pid"], used_bytes=p["used_bytes"]) for p in gpu["processes"]
            ),
            # C function name -> the NVML return code it gives for this device.
            fail=gpu.get("fail", {}),
        )
        for gpu in json.loads(Path(_DESCRIPTION).read_text())["gpus"]
    ]
    install(FakeNvmlLibrary(_gpus))
