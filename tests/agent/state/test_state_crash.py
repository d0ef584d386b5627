"""Crash safety: a writer killed with SIGKILL loses nothing it committed and corrupts nothing."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvpilot.agent.state import StateStore

DEADLINE_S = 60.0

# Commits (outbox row + audit record) in a loop, reporting each commit after it returns.
WRITER = """
import sys
from pathlib import Path
from kvpilot.agent.model import AlertEvent
from kvpilot.agent.state import StateStore

store = StateStore.open(Path(sys.argv[1]))
n = 0
while True:
    event = AlertEvent(f"fp{n}", f"inc{n}", "firing", (("alertname", "x"),), (), float(n), None, "")
    with store.transaction():
        store.outbox.enqueue("hook", event, float(n))
        store.record_audit(wall_s=float(n), actor="rule", action="notify", target=f"fp{n}",
                           decision="queued", reason="firing", details={"pad": "x" * 2000})
    print(n, flush=True)
    n += 1
"""

# Commits `sys.argv[2]` rows, then holds a large uncommitted transaction open.
HOLDER = """
import sys, time
from pathlib import Path
from kvpilot.agent.state import StateStore

store = StateStore.open(Path(sys.argv[1]))
for n in range(int(sys.argv[2])):
    store.set_fact(f"committed/{n}", n, float(n))
print("committed", flush=True)
with store.transaction():
    for n in range(5000):
        store.set_fact(f"uncommitted/{n}", "y" * 500, 0.0)
    print("inside", flush=True)
    time.sleep(3600)  # held open until the test kills this process
"""


def start(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def read_lines_until(proc: subprocess.Popen[bytes], done: Callable[[list[str]], bool]) -> list[str]:
    """Lines from the child until `done(lines)`; fails at the deadline or if the child exits."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    lines: list[str] = []
    pending = b""
    deadline = time.monotonic() + DEADLINE_S
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while not done(lines):
            left = deadline - time.monotonic()
            assert left > 0, f"child too slow; got {len(lines)} lines"
            if not selector.select(timeout=left):
                continue
            chunk = os.read(fd, 65536)  # unbuffered: select() sees every byte not yet read
            assert chunk, f"child exited with {proc.wait()} after {len(lines)} lines"
            *complete, pending = (pending + chunk).split(b"\n")
            lines.extend(line.decode() for line in complete)
    return lines


def kill(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=DEADLINE_S) == -signal.SIGKILL


def test_sigkill_mid_writing_keeps_every_commit(tmp_path: Path) -> None:
    proc = start(WRITER, str(tmp_path))
    try:
        lines = read_lines_until(proc, lambda lines: len(lines) >= 300)
    finally:
        kill(proc)
    reported = {int(line) for line in lines}
    with StateStore.open(tmp_path) as store:
        assert store.integrity_check() == "ok"
        queued = {
            int(i.dedup_key.split(":")[0].removeprefix("fp"))
            for i in store.outbox.due(1e9, limit=10**6)
        }
        audited = {int(r.target.removeprefix("fp")) for r in store.audit_records(limit=10**6)}
        assert reported <= queued
        assert queued == audited  # each transaction landed whole or not at all
        assert len(queued) - len(reported) <= 1  # at most the commit not yet reported
        store.set_fact("still", "writable", 1.0)  # no lock or journal left behind
        assert store.get_fact("still") == "writable"


def test_sigkill_inside_a_transaction_rolls_it_back(tmp_path: Path) -> None:
    proc = start(HOLDER, str(tmp_path), "50")
    try:
        read_lines_until(proc, lambda lines: "inside" in lines)
    finally:
        kill(proc)
    with StateStore.open(tmp_path) as store:
        assert store.integrity_check() == "ok"
        assert [store.get_fact(f"committed/{n}") for n in range(50)] == list(range(50))
        assert store.get_fact("uncommitted/0") is None
        assert store.get_fact("uncommitted/4999") is None
