"""Where a steady tick's CPU goes: py-spy samples a running `kvpilot run` process.

The agent watches N stand-in servers (the same helper as ``agent_footprint.py``: the recorded
vLLM payload and a kvpool payload on loopback) from a YAML configuration with the attach
runtime, ticking at 1 Hz. After WARMUP ticks, ``py-spy record`` samples the process for SPAN
seconds at RATE Hz; the samples are folded per function. Printed: the share of the samples
(of those where the process was on a CPU) that each function holds itself and, for kvpilot's
and the libraries' functions, with what it calls. A sampling profiler needs ptrace rights
(``py-spy`` is a dev tool: ``.venv/bin/pip install py-spy``).

    .venv/bin/python benchmarks/tick_profile.py [--servers 8] [--span 30] [--top 40]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agent_footprint as footprint  # a sibling script, not a package


def fold(raw: str) -> tuple[Counter[str], Counter[str], int]:
    """(self samples per frame, inclusive samples per frame, all samples) from py-spy's raw
    output: one line per stack, ``frame;frame;... count``, root first."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(frame) for frame in stack.split(";")]
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return own, inclusive, total


def _short(frame: str) -> str:
    """``function (path:line)`` as ``function (module path)``, without the line."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/main/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{name} ({path})"


def record(pid: int, span_s: float, rate: int, out: Path) -> str:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    argv = [spy, "record", "--pid", str(pid), "--duration", f"{span_s:.0f}", "--rate", str(rate)]
    argv += ["--format", "raw", "--output", str(out), "--nonblocking"]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not out.exists():
        raise footprint.BenchError(f"py-spy failed: {result.stderr.strip()[-400:]}")
    return out.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=8, help="servers watched (default 8)")
    parser.add_argument("--span", type=float, default=30.0, help="seconds sampled (default 30)")
    parser.add_argument("--rate", type=int, default=250, help="samples per second (default 250)")
    parser.add_argument("--warmup", type=int, default=10, help="ticks before (default 10)")
    parser.add_argument("--top", type=int, default=40, help="functions shown (default 40)")
    parser.add_argument("--raw", type=Path, help="also keep py-spy's raw stacks here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpilot-tick-profile-") as tmp_name:
        tmp = Path(tmp_name)
        root = footprint.import_root(footprint.ROOT, tmp / "root")
        payloads, ports = footprint._start_payloads(tmp, root, args.servers)
        try:
            setup = footprint.Setup(tmp, root, root, "-", ports["vllm"], ports["kvpool"])
            agent = footprint.start_agents(footprint.CANDIDATE, args.servers, setup)[0]
            try:
                footprint._wait_for_ticks("profile", [agent], args.warmup, timeout_s=120)
                cpu0, t0 = footprint.cpu_seconds([agent.process.pid]), time.monotonic()
                raw = record(agent.process.pid, args.span, args.rate, tmp / "raw.txt")
                cpu = footprint.cpu_seconds([agent.process.pid]) - cpu0
                elapsed = time.monotonic() - t0
            finally:
                footprint._stop(agent.process)
        finally:
            footprint._stop(payloads)
    if args.raw is not None:
        args.raw.write_text(raw)
    own, inclusive, total = fold(raw)
    print(
        f"{args.servers} server(s), {elapsed:.0f} s: {100 * cpu / elapsed:.2f} % of a core "
        f"(py-spy's own reads included), {total} samples on a CPU"
    )
    print(f"\nself time, top {args.top}")
    for frame, count in own.most_common(args.top):
        print(f"  {100 * count / total:6.1f} %  {frame}")
    print(f"\nwith callees, top {args.top}")
    for frame, count in inclusive.most_common(args.top):
        print(f"  {100 * count / total:6.1f} %  {frame}")


if __name__ == "__main__":
    try:
        main()
    except footprint.BenchError as exc:
        print(f"tick_profile: {exc}", file=sys.stderr)
        sys.exit(1)
