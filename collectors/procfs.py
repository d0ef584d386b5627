"""Processes as /proc shows them: command lines, parents, start times, trees, memory.

The one module that reads /proc; it only reads. Signalling lives in `agent/runtimes`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

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


def live_group_members(pgid: int, proc_root: Path = PROC) -> list[int]:
    """PIDs in process group `pgid` that have not exited (zombies excluded)."""
    return sorted(
        info.pid for info in list_processes(proc_root).values() if info.pgid == pgid and info.alive
    )


def read_mem_available_bytes(proc_root: Path = PROC) -> int | None:
    """`MemAvailable` from /proc/meminfo, or None when it cannot be read."""
    try:
        for line in (proc_root / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True, slots=True)
class ResidentMemory:
    """The server's processes' resident memory; `missing_pids` could not be read."""

    anon_bytes: int
    rss_bytes: int
    pids_read: int
    missing_pids: tuple[int, ...]


def read_resident_memory(pids: Iterable[int], proc_root: Path = PROC) -> ResidentMemory:
    """Sum of VmRSS and RssAnon over `pids` from /proc/PID/status."""
    anon = rss = read = 0
    missing = []
    for pid in sorted(pids):
        fields = _status_fields(proc_root / str(pid) / "status")
        if fields is None or "VmRSS" not in fields:
            missing.append(pid)
            continue
        read += 1
        rss += fields["VmRSS"]
        anon += fields.get("RssAnon", fields["VmRSS"])
    return ResidentMemory(anon, rss, read, tuple(missing))


def read_pss_bytes(pid: int | str, proc_root: Path = PROC) -> int | None:
    """Proportional set size from /proc/PID/smaps_rollup (shared pages split among their
    users, so processes' figures add up), or None when it cannot be read."""
    fields = _status_fields(proc_root / str(pid) / "smaps_rollup")
    return None if fields is None else fields.get("Pss")


def _status_fields(path: Path) -> dict[str, int] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[name] = int(parts[0]) * 1024
    return out


# -- the checks --------------------------------------------------------------------------


def read_status_text(pid: int | str, proc_root: Path = PROC) -> str | None:
    """`/proc/PID/status` as text (`pid` may be "self"), or None when it cannot be read."""
    try:
        return (proc_root / str(pid) / "status").read_text()
    except OSError:
        return None


def read_pid_namespace(pid: int | str, proc_root: Path = PROC) -> str | None:
    """The PID namespace a process lives in (`pid:[4026531836]`), or None when unreadable
    (another user's link needs ptrace rights)."""
    try:
        return os.readlink(proc_root / str(pid) / "ns" / "pid")
    except OSError:
        return None


def read_uids(pid: int, proc_root: Path = PROC) -> tuple[int, int] | None:
    """A process's real and effective user ids (`Uid:` of /proc/PID/status); None when gone."""
    text = read_status_text(pid, proc_root)
    for line in (text or "").splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            if len(fields) >= 3 and fields[1].isdigit() and fields[2].isdigit():
                return int(fields[1]), int(fields[2])
    return None
