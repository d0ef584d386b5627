"""The GPU's memory as tuning sees it. The stable server's own memory is room for the search:
a promotion restarts it with the new flags, and it gives its memory back first (the restart
pre-flight counts free plus the server's own the same way). A parallel canary, though, runs
beside the stable server, in the memory NVML reports free now: where a canary at the top of
the range does not fit there, trials run in sequence, and the reason is said."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.collectors.nvml import gpu_from_nvml
from kvpilot.collectors.vllm_argv import flag_value
from kvpilot.tuner.problem.space import Knob
from kvpilot.tuner.rollout.canary import Strategy

# vLLM's default --gpu-memory-utilization, for a stable server not running yet.
VLLM_DEFAULT_UTILIZATION = 0.9


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One GPU's memory as NVML reports it now."""

    total_bytes: int
    free_bytes: int
    name: str = ""
    server_used_bytes: int = 0  # the stable server's own processes on it (0: none running)

    @property
    def room_bytes(self) -> int:
        """What a restarted stable server may take: free plus its own."""
        return self.free_bytes + self.server_used_bytes


def read_gpu(server_pids: frozenset[int] = frozenset()) -> GpuMemory | None:
    """The first GPU's memory from NVML, with the use of the stable server's processes
    (`server_pids` and their children); None where there is no GPU (the CPU build, where no
    GPU simply means the KV-budget knob)."""
    found = gpu_from_nvml(0, server_pids)
    return None if isinstance(found, str) else GpuMemory(*found)


def canary_strategy(
    configured: Strategy, knob: Knob, gpu: GpuMemory | None, stable_argv: Sequence[str]
) -> tuple[Strategy, str | None]:
    """The strategy trials run with, and why it is not the configured one (None: it is).
    Parallel on one GPU only where a canary at the top of the utilisation range fits in the
    memory left beside the stable server (running, or at its flags' utilisation once
    started)."""
    if configured is not Strategy.PARALLEL or gpu is None:
        return configured, None
    if knob.name != "gpu_memory_utilization" or knob.high is None:
        return configured, None
    if gpu.server_used_bytes > 0:
        beside = gpu.free_bytes
    else:
        flag = flag_value(stable_argv, "--gpu-memory-utilization")
        stable = float(flag) if flag is not None else VLLM_DEFAULT_UTILIZATION
        beside = gpu.free_bytes - math.ceil(gpu.total_bytes * stable)
    need = math.ceil(gpu.total_bytes * float(knob.high))
    if need <= beside:
        return configured, None
    return Strategy.SEQUENTIAL, (
        f"trials run in sequence: a canary at gpu_memory_utilization {float(knob.high):g} "
        f"needs {_gib(need)}, and {_gib(max(0, beside))} is free beside the stable server"
    )


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"
