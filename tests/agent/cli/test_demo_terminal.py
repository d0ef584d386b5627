"""`kvpilot demo` in a pseudo-terminal of 150 x 50, read back through a terminal emulator
(pyte) with its scrollback: the view draws in place (no copy of it above the screen), and
the log of the same run tells the four phases. The only end-to-end run of the demo: one
scenario, several vLLM starts (the server, its restart, the canaries, the promotion)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from kvpilot.rig.server import TINY_MODEL_DIR, free_port

COLS, ROWS = 150, 50
HEADER = re.compile(r"kvpilot demo: http://127\.0\.0\.1:\d+ ")
DEADLINE_S = 840.0


def _our_vllms() -> set[int]:
    """vLLM servers on this checkout's tiny model (another checkout's are not ours)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and str(TINY_MODEL_DIR).encode() in argv:
            found.add(int(entry.name))
    return found


def _run_in_pty(argv: list[str], screen: object, stream: object) -> int:
    """Runs argv on a pty of COLS x ROWS, feeding its output to `stream`; its exit code."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal's size, then the demo
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
        env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(COLS), LINES=str(ROWS))
        os.execve(argv[0], argv, env)  # noqa: S606 (an argv list, no shell)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            stream.feed(data)  # type: ignore[attr-defined]
        else:
            os.kill(pid, signal.SIGINT)  # the demo's own shutdown path, then the verdict
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.slow
@pytest.mark.timeout(900)
# Quiet: the demo pins its servers to both cores, and no other test's vLLM may start
# beside it while it checks that it left none of its own behind.
@pytest.mark.usefixtures("quiet_machine")
def test_the_demo_in_a_terminal_plays_four_phases_and_leaves_no_debris(tmp_path: Path) -> None:
    pyte = pytest.importorskip("pyte")
    before = _our_vllms()
    log_file = tmp_path / "demo.log"
    screen = pyte.HistoryScreen(COLS, ROWS, history=5000)
    stream = pyte.ByteStream(screen)
    # One trial: the session's mechanics are the same as with the default two, a minute
    # (a canary start and a promotion) shorter.
    argv = [
        sys.executable,
        "-c",
        "from kvpilot.agent.cli import main; main()",
        "demo",
        "--listen-port",
        str(free_port()),
        "--log-file",
        str(log_file),
        "--trials",
        "1",
    ]
    started = time.monotonic()
    code = _run_in_pty(argv, screen, stream)
    took = time.monotonic() - started
    log = log_file.read_text()
    print(f"demo took {took:.0f} s")
    assert code == 0, log[-3000:]

    history = ["".join(c.data for c in line.values()) for line in screen.history.top]
    shown = history + list(screen.display)
    headers = [line for line in shown if HEADER.search(line)]
    # The view redraws in place: at most its last frame's header, never a pile of them.
    assert len(headers) <= 1, "\n".join(history[-60:])

    phases = [re.search(rf"phase {n}/4: [a-z ]+: ", log) for n in (1, 2, 3, 4)]
    assert all(phases), log[-3000:]
    assert phases[0].start() < phases[1].start() < phases[2].start() < phases[3].start()  # type: ignore[union-attr]
    burst = log[phases[1].start() : phases[2].start()]  # type: ignore[union-attr]
    assert "VllmPreemptionSpike pending" in burst and "VllmPreemptionSpike firing" in burst
    assert re.search(r"num_preemptions_total rose from \d+ to [1-9]", burst)
    assert "webhook received: VllmPreemptionSpike firing (signature verified)" in burst
    assert re.search(r"remediation: restart succeeded", burst)
    tuning = log[phases[2].start() : phases[3].start()]  # type: ignore[union-attr]
    assert re.search(r"trial \d+ \(.*\): (complete|infeasible|failed|aborted), ", tuning)
    again = log[phases[3].start() :]  # type: ignore[union-attr]
    assert re.search(r"burst again: (no spike|spike came)", again)
    assert "summary:" in log
    assert "maximum number of running instances" not in log
    assert _our_vllms() <= before, "the demo left a vLLM server behind"
