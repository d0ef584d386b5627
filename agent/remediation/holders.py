"""Who holds device memory before a start: each process on the GPUs that is not the running
server, with its command line and MiB, and whether it is a leftover of this very server.

A leftover (an engine that outlived a killed API server, vLLM issue 55510) is no longer the
server's descendant, so NVML does not count it as the server; it still carries the mark the
runtime put in the server's environment, or the server's own command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.agent.model import Instance
from kvpilot.agent.runtimes.processes import SERVER_MARK_ENV
from kvpilot.collectors.gpu_samples import NvmlSnapshot
from kvpilot.collectors.procfs import PROC, read_environ, read_proc
from kvpilot.collectors.secrets import mask_text

MIB = 1024 * 1024
COMMAND_CHARS = 160  # enough to tell `VLLM::EngineCore` from `python train.py ...`


@dataclass(frozen=True, slots=True)
class DeviceHolder:
    """One process holding memory on a GPU the server would start on."""

    gpu: int
    host_pid: int
    pid: int | None  # in the agent's PID namespace; None when not visible here
    command: str  # masked and shortened; empty when unreadable
    used_bytes: int | None
    own_leftover: bool

    def describe(self) -> str:
        used = "an unknown amount" if self.used_bytes is None else f"{self.used_bytes // MIB} MiB"
        pid = self.pid if self.pid is not None else f"{self.host_pid} (host)"
        command = f" ({self.command})" if self.command else ""
        whose = ", a leftover of this server" if self.own_leftover else ""
        return f"pid {pid}{command} holds {used} on GPU {self.gpu}{whose}"


def server_marks(instance: Instance, proc_root: Path = PROC) -> frozenset[str]:
    """The marks the server's own live processes carry (what a leftover of it carries too)."""
    marks = set()
    for pid in instance.pids:
        mark = (read_environ(pid, proc_root) or {}).get(SERVER_MARK_ENV)
        if mark:
            marks.add(mark)
    return frozenset(marks)


def _command(argv: Sequence[str]) -> str:
    text = mask_text(" ".join(argv))
    return text if len(text) <= COMMAND_CHARS else text[: COMMAND_CHARS - 3] + "..."


def device_holders(
    nvml: NvmlSnapshot,
    instance: Instance,
    *,
    marks: frozenset[str] = frozenset(),
    proc_root: Path = PROC,
) -> tuple[DeviceHolder, ...]:
    """Every process on a GPU that is not the running server, most memory first."""
    marks = marks | server_marks(instance, proc_root)
    holders = []
    for gpu in nvml.gpus:
        for process in gpu.processes or ():
            if process.is_server:
                continue
            pid = process.container_pid
            info = read_proc(pid, proc_root) if pid is not None else None
            argv = info.argv if info is not None else ()
            env = read_environ(pid, proc_root) if pid is not None else None
            leftover = bool(
                (env is not None and env.get(SERVER_MARK_ENV) in marks)
                or (argv and instance.argv and tuple(argv) == tuple(instance.argv))
            )
            holders.append(
                DeviceHolder(
                    gpu=gpu.index,
                    host_pid=process.host_pid,
                    pid=pid,
                    command=_command(argv),
                    used_bytes=process.used_bytes,
                    own_leftover=leftover,
                )
            )
    holders.sort(key=lambda h: -(h.used_bytes or 0))
    return tuple(holders)


def holders_text(holders: Sequence[DeviceHolder]) -> str:
    """`; held by: ...` for a reason, or nothing when no other process holds memory."""
    if not holders:
        return ""
    return "; held by: " + "; ".join(holder.describe() for holder in holders)
