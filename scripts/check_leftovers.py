"""Fails when a process the test run started is still alive at its end, and kills it.

`scripts/test` exports RUN_ENV=<a value of its own> (and SPT_NOENV=1, so that a process that
renames itself, as vLLM's engine and workers do, keeps /proc/PID/environ readable); every
process it starts inherits both. Any live process whose environment carries the value, other
than this check and the processes it runs under, is a leftover: printed (PID and command
line), killed, and the exit status is 1. Other processes on the machine (another user's
vLLM, another run's) are not counted. Only the standard library.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

RUN_ENV = "KVPILOT_TEST_RUN"
PROC = Path("/proc")


def _read(pid: int, name: str, proc: Path) -> bytes | None:
    try:
        return (proc / str(pid) / name).read_bytes()
    except OSError:  # gone, or another user's
        return None


def _stat(pid: int, proc: Path) -> tuple[str, int] | None:
    """(state, parent PID) from /proc/PID/stat."""
    raw = _read(pid, "stat", proc)
    if raw is None:
        return None
    fields = raw.decode(errors="replace").rsplit(")", 1)[-1].split()
    return fields[0], int(fields[1])


def _ancestors(pid: int, proc: Path) -> set[int]:
    """`pid` and every process above it (the shell running the suite carries the mark too)."""
    seen = set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        stat = _stat(pid, proc)
        pid = stat[1] if stat is not None else 0
    return seen


def leftovers(
    run: str, proc: Path = PROC, *, me: int | None = None, only: int | None = None
) -> list[tuple[int, str]]:
    """(PID, command line) of each live process marked with `run`, this one's line aside
    (`only`: that PID alone)."""
    spared = _ancestors(os.getpid() if me is None else me, proc)
    marker = f"{RUN_ENV}={run}".encode()
    pids = [only] if only is not None else [int(e.name) for e in proc.iterdir() if e.name.isdigit()]
    found = []
    for pid in pids:
        if pid in spared:
            continue
        environ = _read(pid, "environ", proc)
        stat = _stat(pid, proc)
        if environ is None or stat is None or stat[0] in ("Z", "X"):
            continue
        if marker in environ.split(b"\0"):
            found.append((pid, _cmdline(pid, proc)))
    return sorted(found)


def _kill(pid: int, run: str) -> None:
    """SIGKILL `pid` through a pidfd, if it still carries the mark (not a reused PID)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # gone
    try:
        if leftovers(run, only=pid):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def _cmdline(pid: int, proc: Path = PROC) -> str:
    raw = (_read(pid, "cmdline", proc) or b"").replace(b"\0", b" ").strip()
    return raw.decode(errors="replace")


def main() -> int:
    run = os.environ.get(RUN_ENV)
    if not run:
        print(f"check_leftovers: {RUN_ENV} is not set: nothing marks this run's processes")
        return 2
    found = leftovers(run)
    for pid, cmdline in found:
        print(f"left running by the tests: PID {pid}: {cmdline[:300]}")
        _kill(pid, run)
    if found:
        print(f"check_leftovers: {len(found)} process(es) outlived the suite (killed now)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
