"""A stand-in for systemd or the kubelet: runs a command, and runs it again when it exits.

Usage: supervisor.py [--hold-file PATH] -- COMMAND [ARG ...]

While the hold file exists, a command that exited is not started again (as if a restart
back-off were in force); removing the file lets the next start happen. SIGTERM or SIGINT
stops the supervisor and its current child.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold-file", type=Path)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    command = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
    stopping = threading.Event()
    child: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, _frame: object) -> None:
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    starts = 0
    while not stopping.is_set():
        while opts.hold_file is not None and opts.hold_file.exists():
            if stopping.wait(0.1):
                return 0
        starts += 1
        child = subprocess.Popen(command)
        print(f"supervisor: start #{starts}: PID {child.pid}", flush=True)
        code = child.wait()
        print(f"supervisor: PID {child.pid} exited with {code}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
