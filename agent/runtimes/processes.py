"""vLLM servers among the processes /proc shows, and signals sent to a process as itself."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvpilot.collectors.procfs import PROC, ProcInfo, ProcRef, is_alive
from kvpilot.collectors.vllm_argv import NotAVllmServer, launch_split, parse_server_argv


def find_vllm_mains(procs: Mapping[int, ProcInfo], *, port: int | None = None) -> list[ProcInfo]:
    """vLLM server main processes: a launch-form command line whose parent is not one.

    Forked children keep their parent's command line until vLLM renames them, so only the
    root of each matching subtree counts. `port` narrows to the server with that `--port`.
    """
    matching = {
        pid: info
        for pid, info in procs.items()
        if info.alive and info.argv and launch_split(info.argv) is not None
    }
    mains = [info for info in matching.values() if info.ppid not in matching]
    if port is not None:
        mains = [info for info in mains if _port_of(info) == port]
    return sorted(mains, key=lambda info: info.pid)


def _port_of(info: ProcInfo) -> int | None:
    try:
        return parse_server_argv(info.argv).port
    except NotAVllmServer:
        return None  # an unparsable --port matches no port


def signal_refs(refs: Iterable[ProcRef], sig: signal.Signals, proc_root: Path = PROC) -> list[int]:
    """Send `sig` to each process still alive as itself; returns the PIDs signalled."""
    sent = []
    for ref in refs:
        if not is_alive(ref, proc_root):
            continue
        try:
            os.kill(ref.pid, sig)
        except ProcessLookupError:
            continue
        sent.append(ref.pid)
    return sent
