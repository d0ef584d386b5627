"""One agent per state directory: the lock excludes a second holder, names the first, and
dies with its holder however it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.agent.state import LOCK_FILENAME, StateLock, StateLocked, StateUnusable

# Takes the lock, says so, then waits to be killed.
HOLDER = """
import sys, time
from pathlib import Path
from kvpilot.agent.state import StateLock

lock = StateLock.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(3600)
"""


def test_a_second_acquire_is_refused_naming_the_holder(tmp_path: Path) -> None:
    with StateLock.acquire(tmp_path):
        with pytest.raises(StateLocked) as refused:
            StateLock.acquire(tmp_path)
        assert refused.value.holder_pid == os.getpid()
        assert f"PID {os.getpid()}" in str(refused.value)
        assert StateLock.holder(tmp_path) == os.getpid()
    assert StateLock.holder(tmp_path) is None
    StateLock.acquire(tmp_path).release()  # free again once released


def test_the_lock_dies_with_its_holder_even_under_sigkill(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(StateLocked) as refused:
            StateLock.acquire(tmp_path)
        assert refused.value.holder_pid == holder.pid
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
    assert (tmp_path / LOCK_FILENAME).exists()  # left behind, and no obstacle
    StateLock.acquire(tmp_path).release()


def test_processes_the_holder_starts_do_not_inherit_the_lock(tmp_path: Path) -> None:
    lock = StateLock.acquire(tmp_path)
    child = subprocess.Popen(["sleep", "60"], close_fds=False)
    try:
        lock.release()
        StateLock.acquire(tmp_path).release()  # the child, still running, holds nothing
    finally:
        child.kill()
        child.wait(timeout=10)


def test_a_directory_that_cannot_hold_the_lock_file_is_unusable(tmp_path: Path) -> None:
    with pytest.raises(StateUnusable, match="cannot create the lock file"):
        StateLock.acquire(tmp_path / "missing")
