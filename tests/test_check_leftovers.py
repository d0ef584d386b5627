"""scripts/check_leftovers.py fails the run on a live process that carries the run's mark, kills
it, and counts no process of another run (real processes, the script run as scripts/test runs
it)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_leftovers.py"
RUN_ENV = "KVPILOT_TEST_RUN"


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait(timeout=10)


def _sleeper(run: str, started: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    env = {**os.environ, RUN_ENV: run}
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    started.append(process)
    return process


def _check(run: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, RUN_ENV: run}
    command = [sys.executable, str(SCRIPT)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


def test_a_process_of_this_run_fails_the_check_and_is_killed(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    run = uuid.uuid4().hex
    ours = _sleeper(run, sleepers)
    theirs = _sleeper(uuid.uuid4().hex, sleepers)  # another run's: not counted
    checked = _check(run)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert f"PID {ours.pid}:" in checked.stdout and "time.sleep(60)" in checked.stdout
    assert f"PID {theirs.pid}:" not in checked.stdout
    ours.wait(timeout=10)  # killed by the check
    assert theirs.poll() is None


def test_a_run_that_left_nothing_passes_and_the_check_spares_its_own_line() -> None:
    # The check's own process and its parents carry the mark as well: not leftovers.
    checked = _check(uuid.uuid4().hex)
    assert (checked.returncode, checked.stdout) == (0, "")


def test_without_the_mark_the_check_says_so() -> None:
    env = {k: v for k, v in os.environ.items() if k != RUN_ENV}
    command = [sys.executable, str(SCRIPT)]
    checked = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 2 and RUN_ENV in checked.stdout
