"""Processes as /proc shows them: command lines, parents, start times, process trees."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpilot.collectors.vllm_argv import NotAVllmServer, launch_split, parse_server_argv

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcRef:
    """A process identity that survives PID reuse: the PID and its start time in ticks."""

    pid: int
    start_ticks: int


@dataclass(frozen=True, slots=True)
class ProcInfo:
    """One process, read from /proc/PID/stat and /proc/PID/cmdline."""

    pid: int
    ppid: int
    pgid: int
    state: str  # R, S, D, Z, ...
    start_ticks: int  # since boot, in clock ticks
    argv: tuple[str, ...]  # empty for kernel threads and unreadable command lines

    @property
    def ref(self) -> ProcRef:
        return ProcRef(self.pid, self.start_ticks)

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def read_proc(pid: int, proc_root: Path = PROC) -> ProcInfo | None:
    """One process, or None if it has gone (or was never there)."""
    base = proc_root / str(pid)
    try:
        stat = (base / "stat").read_text()
        raw = (base / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError:
        raw = b""
        try:
            stat = (base / "stat").read_text()
        except OSError:
            return None
    # The command name in parentheses may hold spaces and parentheses: split after the last.
    fields = stat[stat.rindex(")") + 2 :].split()
    argv = tuple(part.decode(errors="replace") for part in raw.split(b"\0")[:-1]) if raw else ()
    return ProcInfo(
        pid=pid,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        state=fields[0],
        start_ticks=int(fields[19]),
        argv=argv,
    )


def list_processes(proc_root: Path = PROC) -> dict[int, ProcInfo]:
    """Every process visible in this PID namespace, by PID."""
    procs = {}
    for entry in proc_root.iterdir():
        if entry.name.isdigit():
            info = read_proc(int(entry.name), proc_root)
            if info is not None:
                procs[info.pid] = info
    return procs


def is_alive(ref: ProcRef, proc_root: Path = PROC) -> bool:
    """Whether that very process (not a later one with its PID) still runs; zombies are dead."""
    info = read_proc(ref.pid, proc_root)
    return info is not None and info.start_ticks == ref.start_ticks and info.alive


def descendants(pid: int, procs: Mapping[int, ProcInfo]) -> list[ProcInfo]:
    """The live processes below `pid` in the tree, breadth first."""
    children: dict[int, list[ProcInfo]] = {}
    for info in procs.values():
        children.setdefault(info.ppid, []).append(info)
    found, frontier = [], [pid]
    while frontier:
        nxt = []
        for parent in frontier:
            for child in children.get(parent, []):
                if child.alive:
                    found.append(child)
                nxt.append(child.pid)
        frontier = nxt
    return found


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


def read_environ(pid: int, proc_root: Path = PROC) -> dict[str, str] | None:
    """A process's initial environment, or None when it cannot be read (other UID)."""
    try:
        raw = (proc_root / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def boot_time_s(proc_root: Path = PROC) -> float | None:
    """The wall time the machine booted, from /proc/stat's btime."""
    try:
        for line in (proc_root / "stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        return None
    return None


def start_wall_s(info: ProcInfo, proc_root: Path = PROC) -> float | None:
    """When the process started, as wall time."""
    boot = boot_time_s(proc_root)
    if boot is None:
        return None
    return boot + info.start_ticks / os.sysconf("SC_CLK_TCK")


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
