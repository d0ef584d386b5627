"""One agent per state directory: an advisory lock on `state_dir/kvpilot.lock`.

`flock` belongs to the open file: the kernel releases it when the holder exits, however it
exits (SIGKILL included), so a lock left by a dead agent never blocks the next one. The
file is never deleted: a second process could otherwise lock a new file while the first
still holds the old one. It holds the holder's PID and host name, for the message.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from types import TracebackType

from kvpilot.agent.state.errors import StateLocked, StateUnusable
from kvpilot.collectors.safe_files import UnsafeFile, open_no_follow

LOCK_FILENAME = "kvpilot.lock"


class StateLock:
    """The held lock of one state directory; `release()` (or process exit) gives it up."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, state_dir: Path) -> StateLock:
        """The lock, or `StateLocked` naming the holder; never waits."""
        path = state_dir / LOCK_FILENAME
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, host = _read_holder(fd)
            os.close(fd)
            raise StateLocked(state_dir, pid, host) from None
        except OSError as exc:
            os.close(fd)
            raise StateUnusable(f"{path}: cannot lock it: {exc.strerror or exc}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, the message lacks the PID
        return cls(fd, path)

    @staticmethod
    def holder(state_dir: Path) -> int | None:
        """The PID of the agent holding `state_dir`, or None when none does."""
        path = state_dir / LOCK_FILENAME
        try:
            fd = open_no_follow(path, os.O_RDONLY, mode=0o644)
        except (FileNotFoundError, UnsafeFile):
            return None  # no lock file, or one no agent could have locked
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _read_holder(fd)[0]
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def __enter__(self) -> StateLock:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _open(path: Path) -> int:
    try:
        # Close-on-exec: the servers the agent starts must not inherit (and so hold) the lock.
        # Never through a symbolic link: one planted here would have its target truncated.
        return open_no_follow(path, mode=0o644)  # a PID and a host name: nothing secret
    except OSError as exc:
        raise StateUnusable(
            f"state_dir {path.parent}: cannot create the lock file {path.name}: "
            f"{exc.strerror or exc}. kvpilot must write its state directory."
        ) from None


def _read_holder(fd: int) -> tuple[int | None, str | None]:
    """The PID and host the holder wrote (None where it has not written them yet)."""
    try:
        words = os.pread(fd, 256, 0).decode(errors="replace").split()
    except OSError:
        return None, None
    pid = int(words[0]) if words and words[0].isdigit() else None
    return pid, (words[1] if len(words) > 1 else None)
