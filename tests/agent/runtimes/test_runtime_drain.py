"""Drain then stop, on real child process groups: graceful exit, forced kill, stragglers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvpilot.agent.runtimes.drain import DrainOutcome, drain_then_kill, wait_for
from kvpilot.rig.server import live_group_members, stop_process_group

# A parent that starts a grandchild in its group, announces readiness, then handles SIGTERM
# as told: "exit" (drain done), "ignore" (a wedged server).
PARENT = """
import signal, subprocess, sys, time
mode = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
if mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
print("ready", flush=True)
time.sleep(300)
"""


@contextlib.contextmanager
def group(mode: str) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        [sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        yield process
    finally:
        stop_process_group(process, grace_s=1.0)


def _drain(process: subprocess.Popen[bytes], drain_timeout_s: float) -> DrainOutcome:
    pgid = process.pid

    def kill() -> list[int]:
        members = live_group_members(pgid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        return members

    return asyncio.run(
        drain_then_kill(
            terminate=lambda: os.kill(process.pid, signal.SIGTERM),
            main_exited=lambda: process.poll() is not None,
            survivors=lambda: live_group_members(pgid),
            kill=kill,
            drain_timeout_s=drain_timeout_s,
            kill_timeout_s=10.0,
        )
    )


def test_a_main_process_that_exits_on_sigterm_is_drained_and_stragglers_killed() -> None:
    with group("exit") as process:
        members = live_group_members(process.pid)
        assert len(members) == 2
        outcome = _drain(process, drain_timeout_s=20.0)
        assert outcome.was_running and outcome.drained
        assert process.returncode == 0
        # The grandchild ignored SIGTERM and outlived its parent: it needed SIGKILL.
        straggler = next(pid for pid in members if pid != process.pid)
        assert outcome.killed_pids == (straggler,)
        assert live_group_members(process.pid) == []


def test_a_main_process_that_ignores_sigterm_is_killed_after_the_drain_deadline() -> None:
    with group("ignore") as process:
        started = time.monotonic()
        outcome = _drain(process, drain_timeout_s=0.5)
        assert outcome.was_running and not outcome.drained
        assert process.pid in outcome.killed_pids
        assert process.wait(timeout=5) == -signal.SIGKILL
        assert 0.5 <= time.monotonic() - started < 10.0
        assert live_group_members(process.pid) == []


def test_an_already_dead_main_process_is_not_counted_as_drained() -> None:
    with group("exit") as process:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        outcome = _drain(process, drain_timeout_s=5.0)
        assert not outcome.was_running and not outcome.drained
        assert len(outcome.killed_pids) == 1  # the orphaned grandchild
        assert live_group_members(process.pid) == []


def test_wait_for_uses_the_clock_it_is_given() -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0  # every look at the clock moves it a second
        return now[0]

    assert not asyncio.run(wait_for(lambda: False, 5.0, clock=clock, poll_s=0.0))
    assert now[0] == pytest.approx(6.0)  # deadline 1 + 5 s, reached at the fifth check
    assert asyncio.run(wait_for(lambda: True, 0.0, clock=clock, poll_s=0.0))
