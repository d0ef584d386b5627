"""The device memory a vLLM server on this machine holds, found by its port: the measured
memory of a tuning trial whose server reports no KV budget."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from kvpilot.agent.runtimes.processes import find_vllm_mains
from kvpilot.collectors.nvml import gpu_from_nvml
from kvpilot.collectors.procfs import list_processes


def server_pids(url: str) -> frozenset[int]:
    """The main processes of the vLLM server listening on `url`'s port (its children are
    found from them)."""
    port = urlsplit(url).port
    if port is None:
        return frozenset()
    return frozenset(p.pid for p in find_vllm_mains(list_processes(), port=port))


def server_device_memory_bytes(
    url: str, pids_of: Callable[[str], frozenset[int]] = server_pids
) -> int | None:
    """The device memory the server at `url` holds on the first GPU, from NVML: the measured
    memory of a trial where the server reports no KV budget (one sized by
    --gpu-memory-utilization); None without a GPU, the server, or NVML's word on its use."""
    pids = pids_of(url)
    if not pids:
        return None
    found = gpu_from_nvml(0, pids)
    if isinstance(found, str):
        return None
    return found[3] or None
