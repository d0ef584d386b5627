"""Map the host PIDs NVML reports to PIDs in our own PID namespace, through ``/proc``.

NVML reports PIDs as the root PID namespace sees them. ``/proc/<pid>/status`` has an ``NSpid:``
line listing the PID in the namespace of that procfs and in each nested namespace, outermost
first, so a procfs of the root namespace (the host's ``/proc``, or our own when we run in the
host's namespace) maps a host PID to ours: the entry at our own nesting depth. A procfs mounted
inside a container shows no host PIDs at all; then nothing maps and the reason says so.

``PPid:`` is relative to the procfs's namespace too, so ancestry is walked in host PIDs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvpilot.collectors.procfs import read_pid_namespace, read_status_text

log = logging.getLogger(__name__)

# The kernel's fixed inode number for the root PID namespace (PROC_PID_INIT_INO).
ROOT_PID_NAMESPACE = "pid:[4026531836]"
_MAX_ANCESTRY = 256


@dataclass(frozen=True, slots=True)
class ProcStatus:
    """The two lines of ``/proc/<pid>/status`` that matter here."""

    ns_pids: tuple[int, ...]
    parent_pid: int | None


def parse_status(text: str) -> ProcStatus | None:
    """Parse ``NSpid:`` (or ``Pid:`` on kernels without it) and ``PPid:``; ``None`` if absent."""
    ns_pids: tuple[int, ...] | None = None
    pid: int | None = None
    parent_pid: int | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "NSpid":
            ns_pids = tuple(int(part) for part in value.split())
        elif key == "Pid":
            pid = int(value)
        elif key == "PPid":
            parent_pid = int(value)
    if not ns_pids:
        if pid is None:
            return None
        ns_pids = (pid,)
    return ProcStatus(ns_pids=ns_pids, parent_pid=parent_pid)


class PidMapper:
    """Builds a :class:`ProcView` per collection; the proc root is injectable for tests."""

    def __init__(self, proc_root: Path | str = Path("/proc")) -> None:
        self._root = Path(proc_root)
        self._logged_reason: str | None = None

    def view(self) -> ProcView:
        """A fresh, lazily filled view of the proc root for one collection."""
        view = ProcView(self._root)
        reason = view.unmapped_reason
        if reason is not None and reason != self._logged_reason:
            log.warning("container PIDs are not mapped: %s", reason)
        self._logged_reason = reason
        return view


class ProcView:
    """One pass over the proc root: reads each status file at most once."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._status: dict[int | str, ProcStatus | None] = {}
        self._namespace: dict[int | str, str | None] = {}
        self._depth: int | None = None
        self._own_namespace: str | None = None
        self.unmapped_reason = self._locate_self()

    def to_local(self, host_pid: int) -> int | None:
        """``host_pid`` as our namespace sees it; ``None`` when it is not visible to us."""
        depth = self._depth
        if depth is None:
            return None
        status = self._read_status(host_pid)
        if status is None or len(status.ns_pids) <= depth:
            return None
        if depth > 0 and not self._in_our_namespace(host_pid, status, depth):
            return None
        return status.ns_pids[depth]

    def local_lineage(self, host_pid: int) -> tuple[int, ...]:
        """Our-namespace PIDs of the process and of its visible ancestors, nearest first."""
        lineage: list[int] = []
        pid: int | None = host_pid
        seen: set[int] = set()
        while pid is not None and pid > 0 and pid not in seen and len(seen) < _MAX_ANCESTRY:
            seen.add(pid)
            local = self.to_local(pid)
            if local is not None:
                lineage.append(local)
            status = self._read_status(pid)
            pid = None if status is None else status.parent_pid
        return tuple(lineage)

    def is_descendant_of(self, host_pid: int, local_pids: Iterable[int]) -> bool:
        """True when the process or an ancestor is one of ``local_pids`` (our namespace)."""
        wanted = frozenset(local_pids)
        return bool(wanted) and any(pid in wanted for pid in self.local_lineage(host_pid))

    def _locate_self(self) -> str | None:
        own = self._read_status("self")
        if own is None:
            return f"{self._root}/self/status is not readable"
        namespace = self._read_namespace("self")
        if len(own.ns_pids) == 1 and namespace != ROOT_PID_NAMESPACE:
            if namespace is None:
                return f"cannot read {self._root}/self/ns/pid"
            return (
                f"{self._root} belongs to a container PID namespace ({namespace}) and shows no "
                "host PIDs; mount the host's /proc and point the collector at it"
            )
        if len(own.ns_pids) > 1:
            outer = self._read_namespace(1)
            if outer is not None and outer != ROOT_PID_NAMESPACE:
                return f"{self._root} belongs to a nested PID namespace ({outer}), not the host's"
        self._depth = len(own.ns_pids) - 1
        self._own_namespace = namespace
        return None

    def _in_our_namespace(self, host_pid: int, status: ProcStatus, depth: int) -> bool:
        # Climb to the ancestor that lives at our depth: a process in a nested namespace descends
        # from the init of that namespace, whose parent lives one level up.
        pid, current = host_pid, status
        for _ in range(_MAX_ANCESTRY):
            if len(current.ns_pids) == depth + 1:
                namespace = self._read_namespace(pid)
                return namespace is not None and namespace == self._own_namespace
            if current.parent_pid is None or current.parent_pid <= 0:
                return False
            pid = current.parent_pid
            parent = self._read_status(pid)
            if parent is None or len(parent.ns_pids) <= depth:
                return False
            current = parent
        return False

    def _read_status(self, pid: int | str) -> ProcStatus | None:
        if pid not in self._status:
            text = read_status_text(pid, self._root)
            self._status[pid] = None if text is None else parse_status(text)
        return self._status[pid]

    def _read_namespace(self, pid: int | str) -> str | None:
        if pid not in self._namespace:
            # Another user's namespace link needs ptrace rights: unknown, not ours.
            self._namespace[pid] = read_pid_namespace(pid, self._root)
        return self._namespace[pid]
