"""What kvpilot opens on disk, as an attacker with a hand in the directory would plant it.

A symbolic link at a path kvpilot writes must be refused, never written through (it would
overwrite the link's target); what kvpilot creates is private; a FIFO, a device or a huge
file where a small file is expected must neither hang nor fill memory.
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from pathlib import Path

import pytest
from pydantic import SecretStr

from kvpilot.agent.app.control_token import MAX_TOKEN_FILE_BYTES, ControlToken
from kvpilot.agent.config.agent import ApiConfig
from kvpilot.agent.config.errors import ConfigError
from kvpilot.agent.runtimes.local import LocalInstanceSpec, LocalRuntime
from kvpilot.agent.state.db import DB_FILENAME
from kvpilot.agent.state.errors import StateUnusable
from kvpilot.agent.state.exclusive import open_exclusive
from kvpilot.agent.state.lock import LOCK_FILENAME, StateLock
from kvpilot.collectors.safe_files import UnsafeFile, read_small_file

VICTIM_TEXT = "someone else's file\n"


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_text(VICTIM_TEXT)
    return path


def test_a_link_planted_as_the_lock_file_is_not_written_through(
    tmp_path: Path, victim: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / LOCK_FILENAME).symlink_to(victim)
    with pytest.raises(StateUnusable, match="symbolic link"):
        open_exclusive(state)
    assert victim.read_text() == VICTIM_TEXT  # the old code truncated it and wrote its PID
    assert StateLock.holder(state) is None


@pytest.mark.parametrize("name", [DB_FILENAME, f"{DB_FILENAME}-wal", f"{DB_FILENAME}-shm"])
def test_a_link_planted_as_the_database_or_its_log_is_refused(tmp_path: Path, name: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    victim = tmp_path / "empty-victim"
    victim.touch()  # empty: SQLite would take it for a new database and write into it
    (state / name).symlink_to(victim)
    with pytest.raises(StateUnusable, match="symbolic link"):
        open_exclusive(state)
    assert victim.stat().st_size == 0


def test_a_fifo_planted_as_the_database_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.mkfifo(state / DB_FILENAME)
    with pytest.raises(StateUnusable, match="not a regular file"):
        open_exclusive(state)


def test_the_state_it_creates_is_private(tmp_path: Path) -> None:
    state = tmp_path / "new" / "state"
    store = open_exclusive(state)
    try:
        assert mode_of(state) == 0o700
        assert mode_of(state / DB_FILENAME) == 0o600
        assert mode_of(state / f"{DB_FILENAME}-wal") == 0o600  # SQLite copies the file's mode
    finally:
        store.close()


def test_a_database_readable_by_others_is_made_private(tmp_path: Path) -> None:
    open_exclusive(tmp_path).close()
    os.chmod(tmp_path / DB_FILENAME, 0o644)
    open_exclusive(tmp_path).close()
    assert mode_of(tmp_path / DB_FILENAME) == 0o600


def _current_within(token: ControlToken, seconds: float) -> tuple[bool, SecretStr | None]:
    """Whether `current()` returned within `seconds`, and what it returned."""
    result: list[SecretStr | None] = []
    thread = threading.Thread(target=lambda: result.append(token.current()), daemon=True)
    thread.start()
    thread.join(seconds)
    return bool(result), (result[0] if result else None)


def test_a_fifo_as_the_token_file_does_not_hang_the_api(tmp_path: Path) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    token = ControlToken(token_file=fifo)
    try:
        returned, value = _current_within(token, 2.0)
        assert returned, "reading the token file blocked on a FIFO without a writer"
        assert value is None
        assert token.problem is not None and "not a regular file" in token.problem
    finally:  # release a reader the old code left blocked in open()
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK) if not returned else None
        if fd is not None:
            os.close(fd)


def test_a_device_as_the_token_file_is_refused_unread() -> None:
    token = ControlToken(token_file=Path("/dev/zero"))
    returned, value = _current_within(token, 2.0)
    assert returned and value is None
    assert token.problem is not None and "not a regular file" in token.problem


def test_small_file_reads_are_capped(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"a" * (MAX_TOKEN_FILE_BYTES + 1))
    with pytest.raises(UnsafeFile, match="over"):
        read_small_file(big, MAX_TOKEN_FILE_BYTES)
    with pytest.raises(UnsafeFile, match="not a regular file"):
        read_small_file(tmp_path, MAX_TOKEN_FILE_BYTES)
    link = tmp_path / "link"
    link.symlink_to(big)
    big.write_bytes(b"token\n")
    assert read_small_file(link, MAX_TOKEN_FILE_BYTES) == b"token\n"  # a mounted Secret


def test_a_fifo_as_the_configured_token_file_does_not_hang_start_up(tmp_path: Path) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    config = ApiConfig(token_file=fifo)
    outcome: list[BaseException | None] = []
    reader = threading.Thread(target=lambda: outcome.append(_raised(config)), daemon=True)
    reader.start()
    reader.join(2.0)
    try:
        assert outcome, "reading api.token_file blocked on a FIFO without a writer"
        assert isinstance(outcome[0], ConfigError)
        assert "not a regular file" in str(outcome[0])
    finally:  # release a reader the old code left blocked in open()
        if not outcome:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def _raised(config: ApiConfig) -> BaseException | None:
    try:
        config.control_token()
    except BaseException as exc:
        return exc
    return None


def test_a_link_planted_as_a_servers_log_is_not_appended_through(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"untouched")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "vllm.log").symlink_to(target)
    argv = ("python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m")
    runtime = LocalRuntime([LocalInstanceSpec("vllm", argv)], logs)
    with pytest.raises(UnsafeFile, match="symbolic link"):
        asyncio.run(runtime.start("vllm", ready_timeout_s=1.0))
    assert target.read_bytes() == b"untouched"
