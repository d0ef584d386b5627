"""vLLM servers among the processes /proc shows, and signals sent to a process as itself."""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from kvpilot.collectors.procfs import (
    PROC,
    ProcInfo,
    ProcRef,
    is_alive,
    list_processes,
    read_environ,
)
from kvpilot.collectors.vllm_argv import NotAVllmServer, launch_split, parse_server_argv

# Each server the local runtime starts carries a mark of its own in its environment, which
# every process it starts inherits: they are found by it even once they have left its process
# group or session, or lost their parent (vLLM's engine and workers outlive a killed API
# server: vLLM issue 55510).
SERVER_MARK_ENV = "KVPILOT_SERVER_MARK"
# vLLM names its engine and workers with py-setproctitle, which overwrites the memory that
# /proc/PID/environ shows unless this is set; the mark must stay readable there.
KEEP_ENVIRON_ENV = ("SPT_NOENV", "1")


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


def send_signal(
    ref: ProcRef,
    sig: signal.Signals,
    proc_root: Path = PROC,
    *,
    still: Callable[[ProcRef], bool] | None = None,
) -> bool:
    """Send `sig` to the process `ref` names if it is still that process (and `still(ref)`
    holds, when given: e.g. it still runs the server it was found as); returns whether sent.

    The signal goes through a pidfd opened before the check, so the process checked is the one
    signalled: a successor that took its PID gets nothing (ESRCH), never the signal.
    """
    try:
        pidfd: int | None = os.pidfd_open(ref.pid)
    except ProcessLookupError:
        return False
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        pidfd = None  # kernels before 5.3: the check alone, a narrower race
    try:
        if not (still(ref) if still is not None else is_alive(ref, proc_root)):
            return False
        if pidfd is None:
            os.kill(ref.pid, sig)
        else:
            signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)


def marked(mark: str, procs: Mapping[int, ProcInfo], proc_root: Path = PROC) -> list[ProcInfo]:
    """The live processes whose environment carries `SERVER_MARK_ENV=mark` (ours only: another
    user's environment cannot be read, and is not counted)."""
    found = []
    for info in procs.values():
        if info.alive and (read_environ(info.pid, proc_root) or {}).get(SERVER_MARK_ENV) == mark:
            found.append(info)
    return found


def signal_refs(refs: Iterable[ProcRef], sig: signal.Signals, proc_root: Path = PROC) -> list[int]:
    """Send `sig` to each process still alive as itself; returns the PIDs signalled."""
    return [ref.pid for ref in refs if send_signal(ref, sig, proc_root)]


def group_refs(pgid: int, proc_root: Path = PROC) -> list[ProcRef]:
    """The live members of process group `pgid`, as identities."""
    procs = list_processes(proc_root).values()
    return sorted((i.ref for i in procs if i.pgid == pgid and i.alive), key=lambda r: r.pid)


def kill_group(pgid: int, proc_root: Path = PROC) -> list[int]:
    """SIGKILL each live member of group `pgid`, one by one through its pidfd; returns PIDs."""
    return signal_refs(group_refs(pgid, proc_root), signal.SIGKILL, proc_root)


class GroupWatch:
    """The processes of the server started, and only those: its process group's members that
    belong to it, and every process that carries its mark (`SERVER_MARK_ENV`), wherever it is.

    A process group's id is its leader's PID, and once every member has gone the kernel may
    give that PID, and so the group id, to an unrelated process. So the group is trusted only
    while its leader is known to hold the id (`leader_holds()`: running, or exited but not
    yet reaped); the members seen then are remembered by identity (PID and start time).
    Afterwards a member counts only if it was seen then, or its parent is one that counts (a
    process the server started meanwhile). A marked process counts whatever its group: the
    mark is the server's own, so no reused id can lend it to a stranger; it finds what left
    the group (setsid, setpgrp) or was orphaned before it was ever seen. Signals go through
    each member's pidfd (`send_signal`), so a PID reused between the check and the signal is
    never hit.
    """

    def __init__(
        self,
        pgid: int,
        leader_holds: Callable[[], bool],
        proc_root: Path = PROC,
        *,
        mark: str | None = None,
    ) -> None:
        self.pgid = pgid
        self._leader_holds = leader_holds
        self._proc_root = proc_root
        self._mark = mark
        self._known: set[ProcRef] = set()
        self.members()  # seen while the caller still holds the leader

    def members(self) -> list[ProcRef]:
        """The live processes that belong to the server, as identities."""
        procs = list_processes(self._proc_root)
        group = {i.pid: i for i in procs.values() if i.pgid == self.pgid and i.alive}
        if self._leader_holds():
            ours = set(group)
        else:
            ours = {i.pid for i in group.values() if i.ref in self._known}
        if self._mark is not None:
            ours |= {i.pid for i in marked(self._mark, procs, self._proc_root)}
        grew = True
        while grew:  # children of processes that count count too
            more = {
                pid for pid, i in procs.items() if pid not in ours and i.alive and i.ppid in ours
            }
            grew = bool(more)
            ours |= more
        self._known.update(procs[pid].ref for pid in ours)
        return sorted((procs[pid].ref for pid in ours), key=lambda r: r.pid)

    def live_pids(self) -> list[int]:
        return [ref.pid for ref in self.members()]

    def kill(self) -> list[int]:
        """SIGKILL each process that belongs to the server; returns the PIDs signalled."""
        return signal_refs(self.members(), signal.SIGKILL, self._proc_root)
