"""Files kvpilot reads or writes where someone else may have put something first.

A small file expected (a token, a secret) may be a FIFO that never ends, a device that
never stops (/dev/zero) or a huge file: it is opened without blocking, refused unless it is a
regular file, and read up to a cap. A file kvpilot creates is created without following a
symbolic link planted at its path (which would make it overwrite the link's target) and
readable by its owner only.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

PRIVATE_FILE_MODE = 0o600
# A token is a line: a larger token file is refused, never read whole.
MAX_TOKEN_FILE_BYTES = 64 * 1024


class UnsafeFile(OSError):
    """The path holds something other than the small regular file expected."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(errno.EINVAL, why, str(path))


def read_small_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path` (symbolic links followed: a mounted Secret is
    one); `UnsafeFile` for a FIFO, a device, a directory or a file over `max_bytes`."""
    # O_NONBLOCK: opening a FIFO with no writer would otherwise wait for ever.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(path, "not a regular file (a FIFO, a device or a directory)")
        if st.st_size > max_bytes:
            raise UnsafeFile(path, f"over {max_bytes} bytes")
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # it grew since fstat
        raise UnsafeFile(path, f"over {max_bytes} bytes")
    return data


def open_no_follow(
    path: Path, flags: int = os.O_RDWR | os.O_CREAT, *, mode: int = PRIVATE_FILE_MODE
) -> int:
    """A descriptor on the regular file at `path`, created with `mode` when missing; a
    symbolic link or anything but a regular file there is refused (`UnsafeFile`), never
    followed. An existing file of ours that grants more than `mode` is narrowed to it."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(path, "a symbolic link, not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(path, "not a regular file (a FIFO, a device or a directory)")
        if stat.S_IMODE(st.st_mode) & ~mode and st.st_uid == os.geteuid():
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_not_planted(path: Path) -> None:
    """`UnsafeFile` when `path` is a symbolic link or not a regular file; a missing path is
    fine (for files another library opens by name, such as SQLite's companions)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFile(path, "a symbolic link, not followed")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(path, "not a regular file (a FIFO, a device or a directory)")
